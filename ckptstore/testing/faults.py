"""A fault-injecting `Backend` wrapper for reliability tests.

Wrap any backend to make chosen operations fail (the Nth call, or a random
fraction) with a transient or permanent error, or to add latency. The wrapper
is itself a `Backend` with its own `RetryPolicy`, so the retry machinery every
real backend uses is what handles the injected faults. It fails calls of the byte API
only: for faults on TensorStore's own HTTP requests too, put a `FaultProxy`
(`ckptstore.testing.faultproxy`) in front of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import tensorstore as ts

from ckptstore.backends import supports
from ckptstore.backends.base import Backend, Buffer, ObjectInfo
from ckptstore.errors import StorageError, TransientStorageError

T = TypeVar("T")

OPERATIONS = frozenset(
    {"read", "write", "create", "list", "list_dir", "stat", "delete", "delete_prefix"}
)


class InjectedFault(TransientStorageError):
    """A transient failure injected by `FaultyBackend`."""


class InjectedPermanentFault(StorageError):
    """A permanent failure injected by `FaultyBackend`."""


class FaultyBackend(Backend):
    """Delegates to ``inner``, failing some operations on purpose.

    - ``fail_on``: 1-based numbers of the (matching) calls that fail.
    - ``fail_rate``: probability that any other matching call fails (seeded).
    - ``error``: "transient" (retryable) or "permanent".
    - ``ops``: operation names subject to faults (default: all of `OPERATIONS`).
    - ``latency``: seconds added before every operation.
    - ``after``: for writes, fail *after* the inner write landed (a lost reply).
    """

    def __init__(
        self,
        inner: Backend,
        *,
        fail_on: Iterable[int] = (),
        fail_rate: float = 0.0,
        error: Literal["transient", "permanent"] = "transient",
        ops: Iterable[str] | None = None,
        latency: float = 0.0,
        after: bool = False,
        seed: int = 0,
        **options: Any,
    ):
        super().__init__(**options)
        self.inner = inner
        self.kind = inner.kind
        self.capabilities = inner.capabilities
        self.fail_on = set(fail_on)
        self.fail_rate = fail_rate
        self.error = error
        self.ops = frozenset(ops) if ops is not None else OPERATIONS
        unknown = self.ops - OPERATIONS
        if unknown:
            raise ValueError(f"unknown operations for fault injection: {sorted(unknown)}")
        self.latency = latency
        self.after = after
        self._rng = random.Random(seed)
        self.calls = 0  # matching calls seen
        self.injected = 0  # faults raised

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def location(self) -> str:
        return self.inner.location

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        return self.inner.kvstore_spec(prefix)

    @property
    def ts_context(self) -> ts.Context:
        return self.inner.ts_context

    def write_behind(self, prefix: str) -> contextlib.AbstractContextManager[object]:
        return supports.write_behind(self.inner, prefix)

    async def remove_temporaries(
        self, older_than: float, *, dry_run: bool = False
    ) -> list[ObjectInfo]:
        return await supports.remove_temporaries(self.inner, older_than, dry_run=dry_run)

    async def sync_dirs(self, prefix: str) -> None:
        await supports.sync_dirs(self.inner, prefix)

    async def prune_dirs(self, prefix: str) -> None:
        await supports.prune_dirs(self.inner, prefix)

    async def close(self) -> None:
        await self.inner.close()

    def _should_fail(self, op: str) -> bool:
        if op not in self.ops:
            return False
        self.calls += 1
        return self.calls in self.fail_on or (
            self.fail_rate > 0 and self._rng.random() < self.fail_rate
        )

    async def _around(self, op: str, key: str | None, call: Callable[[], Awaitable[T]]) -> T:
        if self.latency:
            await asyncio.sleep(self.latency)
        fail = self._should_fail(op)
        if fail and not self.after:
            self._raise(op, key)
        result = await call()
        if fail:
            self._raise(op, key)
        return result

    def _raise(self, op: str, key: str | None) -> None:
        self.injected += 1
        cls = InjectedFault if self.error == "transient" else InjectedPermanentFault
        raise cls(f"injected {self.error} fault in {op}", backend=self.url, key=key)

    async def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        return await self._around("read", key, lambda: self.inner.read(key, start, end))

    async def _write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await self._around("write", key, lambda: self.inner.write(key, data))

    async def _write_gather(self, key: str, parts: Sequence[Buffer]) -> None:
        # A "write" fault, on the inner backend's own gathered write (streamed on local disk)
        await self._around("write", key, lambda: self.inner.write_gather(key, parts))

    async def _create(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await self._around("create", key, lambda: self.inner.create(key, data))

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        async def collect() -> list[ObjectInfo]:
            return [info async for info in self.inner.list(prefix)]

        return await self._around("list", prefix, collect)

    async def _list_dir(self, prefix: str) -> list[str]:
        return await self._around("list_dir", prefix, lambda: self.inner.list_dir(prefix))

    async def _stat(self, key: str) -> ObjectInfo:
        return await self._around("stat", key, lambda: self.inner.stat(key))

    async def _delete(self, key: str) -> None:
        await self._around("delete", key, lambda: self.inner.delete(key))

    async def _delete_prefix(self, prefix: str) -> int:
        return await self._around("delete_prefix", prefix, lambda: self.inner.delete_prefix(prefix))
