"""In-memory backend: one TensorStore memory kvstore shared with TensorStore itself.

Backends opened with the same name (``memory://NAME``) in one process share
the same `tensorstore.Context`, hence the same bytes; byte operations and
TensorStore arrays opened from `kvstore_spec` see each other's writes.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import tensorstore as ts

from ckptstore.backends.base import Backend, Capabilities, ObjectInfo, slice_range
from ckptstore.backends.keys import validate_prefix
from ckptstore.errors import AlreadyExistsError, NotFoundError

_NO_VALUE = b"\x02"  # TensorStore's storage generation of a missing key

_contexts: dict[str, ts.Context] = {}
_contexts_lock = threading.Lock()


def _shared_context(name: str) -> ts.Context:
    with _contexts_lock:
        if name not in _contexts:
            _contexts[name] = ts.Context()
        return _contexts[name]


def forget(name: str) -> None:
    """Drop the named in-memory store so its bytes can be freed."""
    with _contexts_lock:
        _contexts.pop(name, None)


class MemoryBackend(Backend):
    """Bytes held by TensorStore's ``memory`` kvstore; lost when the process exits."""

    kind = "memory"
    capabilities = Capabilities(
        atomic_rename=False, conditional_create=True, server_side_copy=False, durable_writes=False
    )

    def __init__(self, name: str | None = None, **options: Any):
        super().__init__(**options)
        self.name = name or f"anon-{uuid.uuid4().hex[:12]}"
        self._ts_context = _shared_context(self.name)
        self._kv: ts.KvStore | None = None

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        norm = validate_prefix(prefix)
        return {"driver": "memory", "path": f"{norm}/" if norm else ""}

    async def _store(self) -> ts.KvStore:
        if self._kv is None:
            self._kv = await ts.KvStore.open({"driver": "memory"}, context=self._ts_context)
        return self._kv

    async def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        result = await (await self._store()).read(key)
        if result.state != "value":
            raise NotFoundError("no such object", backend=self.url, key=key)
        return slice_range(bytes(result.value), start, end)

    async def _write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await (await self._store()).write(key, bytes(data))

    async def _create(self, key: str, data: bytes | bytearray | memoryview) -> None:
        stamp = await (await self._store()).write(key, bytes(data), if_equal=_NO_VALUE)
        if stamp.generation == b"":
            raise AlreadyExistsError("object already exists", backend=self.url, key=key)

    async def _keys(self, prefix: str) -> list[str]:
        kv = await self._store()
        if not prefix:
            raw = await kv.list()
        else:
            raw = await kv.list(ts.KvStore.KeyRange(prefix + "/", prefix + "0"))  # '0' follows '/'
        return sorted(k.decode() for k in raw)

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        kv = await self._store()
        infos = []
        for key in await self._keys(prefix):
            result = await kv.read(key)
            if result.state == "value":
                infos.append(ObjectInfo(key, len(result.value), result.stamp.time))
        return infos

    async def _list_dir(self, prefix: str) -> list[str]:
        start = len(prefix) + 1 if prefix else 0
        return sorted({k[start:].split("/", 1)[0] for k in await self._keys(prefix)})

    async def _stat(self, key: str) -> ObjectInfo:
        result = await (await self._store()).read(key)
        if result.state != "value":
            raise NotFoundError("no such object", backend=self.url, key=key)
        return ObjectInfo(key, len(result.value), result.stamp.time)

    async def _delete(self, key: str) -> None:
        await (await self._store()).write(key, None)

    async def _delete_prefix(self, prefix: str) -> int:
        keys = await self._keys(prefix)
        await (await self._store()).delete_range(ts.KvStore.KeyRange(prefix + "/", prefix + "0"))
        return len(keys)
