"""Writing and reading packs (`ckptstore.format.packs` says what a pack is): one gathered
write per pack, the writer's record of its packed leaves, the check a save makes before it
commits, and ranged reads of consecutive entries into aligned buffers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.backends.base import Backend
from ckptstore.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
    ShortReadError,
)
from ckptstore.format import chunks
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.packs import INDEX, PackRef, chunk_size, entry_size, pack_parts, pack_refs
from ckptstore.runtime.futures import gather_first_error, on_thread
from ckptstore.runtime.gcpause import gc_paused
from ckptstore.runtime.hostpool import aligned_empty


@dataclass(frozen=True)
class PackTarget:
    """Where a writer packs small leaves: objects ``<store>/pack-<k>`` below ``prefix``
    (the item's directory) on ``backend``."""

    backend: Backend
    prefix: str
    store: str

    def key(self, k: int) -> str:
        return f"{self.store}/pack-{k}"


async def write_index(backend: Backend, store: str, refs: Mapping[str, PackRef]) -> None:
    """Record ``refs`` (a writer's packed leaves) in ``store`` (its directory)."""
    with gc_paused():  # an object per leaf: see `ckptstore.runtime.gcpause`
        doc = {leaf: ref.to_json() for leaf, ref in refs.items()}
        data = json.dumps(doc, separators=(",", ":")).encode()
    await backend.write(_join(store, INDEX), data)


async def read_index(backend: Backend, store: str) -> dict[str, PackRef]:
    """The packed leaves a writer recorded in ``store``; a malformed record is corruption."""
    key = _join(store, INDEX)
    try:
        data = await backend.read(key)
        with gc_paused():  # an object per leaf: see `ckptstore.runtime.gcpause`
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            return {leaf: PackRef.from_json(leaf, ref) for leaf, ref in doc.items()}
    except ValueError as exc:  # json's errors too
        raise CorruptCheckpointError(f"unreadable pack index {key}: {exc}") from exc


async def write_pack(
    backend: Backend,
    prefix: str,
    key: str,
    leaves: Sequence[tuple[LeafInfo, Any]],
    *,
    encoding: asyncio.Lock | None = None,
) -> list[PackRef]:
    """Write one pack of ``leaves`` at ``key`` below ``prefix`` (the item's directory);
    returns each leaf's `PackRef`, in order.

    ``encoding``, shared by the packs of one save, is held while this pack's checksums are
    computed: packs are then encoded one at a time, in the order they ask, and the first
    reaches storage while the next is encoded. Encoded all at once (they share the
    interpreter lock and a few cores), every pack would be ready only when the last is,
    and the storage would wait for all of them (tree c's saves were slower so)."""
    async with encoding or contextlib.nullcontext():
        parts, offsets = await on_thread(None, lambda: pack_parts(leaves))
    await backend.write_gather(_join(prefix, key), parts)
    return pack_refs(key, leaves, parts, offsets)


async def check_packs(
    backend: Backend, prefix: str, leaves: Sequence[tuple[LeafInfo, PackRef]]
) -> None:
    """Raise `IncompleteCheckpointError` naming every leaf whose pack (below ``prefix``)
    is missing or ends before the leaf does: a save checks this before it commits."""
    keys = list(dict.fromkeys(ref.key for _, ref in leaves))

    async def size(key: str) -> int | None:
        try:
            return (await backend.stat(_join(prefix, key))).size
        except NotFoundError:
            return None

    sizes = dict(zip(keys, await gather_first_error(map(size, keys)), strict=True))
    problems = {}
    for info, ref in leaves:
        have, need = sizes[ref.key], ref.offset + entry_size(info, ref)
        if have is None:
            problems[info.name] = f"its pack {ref.key} is missing"
        elif have < need:
            problems[info.name] = f"its pack {ref.key} holds {have} bytes, {need} expected"
    if problems:
        raise IncompleteCheckpointError(
            f"{len(problems)} packed leaves are not all there", leaves=problems
        )


async def read_packed(
    backend: Backend, prefix: str, leaves: Sequence[tuple[LeafInfo, PackRef]]
) -> list[np.ndarray[Any, Any]]:
    """Each leaf's array, from packs below ``prefix`` (the item's directory). Leaves that
    follow one another in a pack are read with one ranged read, each into an aligned
    buffer of its own; a checksum, size or reference that does not match is corruption."""
    out: list[np.ndarray[Any, Any] | None] = [None] * len(leaves)
    metas = [chunks.encode_metadata(info) for info, _ in leaves]  # what each entry starts with
    read = _RunReader(backend, prefix, leaves, metas, out)
    pairs = zip(metas, leaves, strict=True)
    sizes = [len(meta) + chunk_size(info, ref) for meta, (info, ref) in pairs]
    await gather_first_error(read.run(indices) for indices in _runs(leaves, sizes))
    assert all(arr is not None for arr in out)
    return out  # type: ignore[return-value]


@dataclass
class _RunReader:
    """`read_packed`'s reads of runs of entries into ``out``. A class, not a closure that
    calls itself: such a closure is a reference cycle, and ``out`` (the restored buffers)
    would outlive the restored tree until the cyclic collector ran (never, for a program
    that turned it off)."""

    backend: Backend
    prefix: str
    leaves: Sequence[tuple[LeafInfo, PackRef]]
    metas: list[bytes]
    out: list[np.ndarray[Any, Any] | None]

    async def run(self, indices: list[int]) -> None:
        leaves, metas = self.leaves, self.metas
        first = leaves[indices[0]][1]
        stored = [bytearray(len(metas[i])) for i in indices]
        bufs = [aligned_empty((chunk_size(*leaves[i]),), _BYTE) for i in indices]
        views = [
            v for meta, buf in zip(stored, bufs, strict=True) for v in (memoryview(meta), buf.data)
        ]
        try:
            await self.backend.read_into(_join(self.prefix, first.key), first.offset, views)
        except ShortReadError as exc:  # the pack ends before these leaves do
            if len(indices) > 1:  # find the first leaf cut off: each alone
                await gather_first_error(self.run([i]) for i in indices)
            name = leaves[indices[-1]][0].name
            raise CorruptCheckpointError(f"pack {first.key} too short: {exc}", leaf=name) from exc
        except NotFoundError as exc:  # a committed step's pack: damage, not a storage failure
            names = ", ".join(leaves[i][0].name for i in indices)
            raise CorruptCheckpointError(
                f"pack {first.key} of {names} is missing", leaf=leaves[indices[0]][0].name
            ) from exc
        await on_thread(None, lambda: self._decode(indices, stored, bufs))

    def _decode(
        self, indices: list[int], stored: list[bytearray], bufs: list[np.ndarray[Any, Any]]
    ) -> None:
        for i, meta, buf in zip(indices, stored, bufs, strict=True):
            info = self.leaves[i][0]
            if meta != self.metas[i]:  # the document a save writes for the manifest's record
                raise CorruptCheckpointError(_disagreement(info, meta), leaf=info.name)
            self.out[i] = chunks.decode_chunk(info, buf, copy=False, key=chunks.chunk_key(info))


async def read_split(
    backend: Backend,
    prefix: str,
    packed: Mapping[str, PackRef],
    infos: Sequence[LeafInfo],
    others: Callable[[list[LeafInfo]], Awaitable[Sequence[np.ndarray[Any, Any]]]],
) -> list[np.ndarray[Any, Any]]:
    """Each of ``infos``' arrays, in order: packed ones from their packs below ``prefix``,
    the rest through ``others`` (a batch reader of the item's store)."""
    mine = [info for info in infos if info.name in packed]
    rest = [info for info in infos if info.name not in packed]

    async def from_packs() -> Sequence[np.ndarray[Any, Any]]:
        return await read_packed(backend, prefix, [(i, packed[i.name]) for i in mine])

    async def from_store() -> Sequence[np.ndarray[Any, Any]]:
        return await others(rest) if rest else []

    a, b = await gather_first_error([from_packs(), from_store()])
    done = {info.name: arr for info, arr in zip(mine, a, strict=True)}
    done.update((info.name, arr) for info, arr in zip(rest, b, strict=True))
    return [done[info.name] for info in infos]


_BYTE = np.dtype(np.uint8)


def _disagreement(info: LeafInfo, meta: bytes | bytearray) -> str:
    """What the ``zarr.json`` stored in a pack says against the manifest's record (read
    at the length the record implies: a record of another dtype may cut it short)."""
    said = f"the manifest says data_type {info.dtype!r}, shape {list(info.shape)}"
    try:
        doc = json.loads(meta)
        stored = f"data_type {doc['data_type']!r}, shape {doc['shape']}"
        same = doc["data_type"] == info.dtype and doc["shape"] == list(info.shape)
        if same and chunks.known(info):
            names = _codec_names(doc)
            expected = _codec_names(json.loads(chunks.encode_metadata(info)))
            if names != expected:  # what differs is the codecs: name them
                return (
                    f"the zarr.json stored in its pack names codecs {names}, where the "
                    f"manifest's record implies {expected}"
                )
    except (ValueError, TypeError, KeyError, AttributeError):
        return f"the zarr.json stored in its pack does not match its record ({said})"
    return f"the zarr.json stored in its pack says {stored}; {said}"


def _codec_names(doc: dict[str, Any]) -> list[str]:
    """The names of a ``zarr.json``'s codecs, in order (a sharding codec's inner ones after
    its own name)."""
    out: list[str] = []
    for codec in doc["codecs"]:
        out.append(str(codec["name"]))
        inner = (codec.get("configuration") or {}).get("codecs")
        if inner:
            out += _codec_names({"codecs": inner})
    return out


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _runs(leaves: Sequence[tuple[LeafInfo, PackRef]], sizes: Sequence[int]) -> list[list[int]]:
    """Indices of ``leaves`` (whose entries are ``sizes`` bytes long) grouped into runs
    that lie one after another in one pack."""
    order = sorted(range(len(leaves)), key=lambda i: (leaves[i][1].key, leaves[i][1].offset))
    runs: list[list[int]] = []
    end: tuple[str, int] | None = None
    for i in order:
        ref = leaves[i][1]
        if end != (ref.key, ref.offset) or len(runs[-1]) >= _MAX_RUN:
            runs.append([])
        runs[-1].append(i)
        end = (ref.key, ref.offset + sizes[i])
    return runs


#: Leaves read by one ranged read at most (one system call takes 1,024 buffers).
_MAX_RUN = 256
