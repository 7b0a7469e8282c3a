"""Leaves <-> TensorStore zarr3 arrays inside OCDBT stores: the I/O.

Each leaf is a zarr3 array whose chunks carry a ``crc32c`` checksum that
TensorStore verifies on every read. A process writes only the shards it owns
(addressable, replica 0) into its own OCDBT store; reads fetch only the slices
each device needs, whatever mesh the arrays were saved from. What each leaf
looks like (`LeafInfo`, chunking) is the schema in `ckptstore.format.leaves`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import jax
import numpy as np
import tensorstore as ts

from ckptstore.backends import supports
from ckptstore.backends.base import Backend
from ckptstore.backends.tsdeadline import policy_of, within
from ckptstore.backends.tserrors import write_error
from ckptstore.datapath.chunkwrites import (
    ChunkPlan,
    unheld_batches,
    unheld_pieces,
    write_in_part,
)
from ckptstore.datapath.declaredwrites import DeclaredLeaf, write_declared
from ckptstore.datapath.packs import PackTarget, write_pack
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES, ocdbt_spec
from ckptstore.errors import CkptStoreError
from ckptstore.format import chunks
from ckptstore.format.digests import ChunkTable, PieceTable, digest, piece_digests, piece_key
from ckptstore.format.leaves import HostShards, Index, LeafInfo, host_array, zarr_spec
from ckptstore.format.packs import PackRef
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.futures import (
    finish_first,
    gather_first_error,
    off_loop,
    on_thread,
    write_keys,
)


@dataclass
class WriteStats:
    """What one process wrote in one save."""

    process: int
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    leaves: list[str] = field(default_factory=list)
    packed: dict[str, PackRef] = field(default_factory=dict)  # where each packed leaf is

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "shards": self.shards,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
        }


def owned_slices(value: Any, process: int) -> list[tuple[Index, Any, bool]]:
    """The (index, data, private) pieces of a leaf that ``process`` must write.

    jax arrays: the addressable shards with replica id 0 (data returned lazily,
    ``shard.data``); staged arrays (`HostShards`): their pieces. Host values belong
    to process 0. ``private`` data is never mutated by anyone else while the save
    runs, so TensorStore may encode straight from it instead of copying it first.
    """
    if isinstance(value, jax.Array):
        if _replicated_in_host_memory(value):  # the array itself: see there
            return [(tuple(slice(None) for _ in value.shape), value, True)]
        return [
            (tuple(shard.index), shard.data, True)
            for shard in value.addressable_shards
            if shard.replica_id == 0
        ]
    if isinstance(value, HostShards):
        return [(index, data, True) for index, data in value.pieces]
    if process != 0:
        return []
    arr = host_array(value)
    return [(tuple(slice(None) for _ in arr.shape), arr, False)]


def host_view_slices(value: Any, process: int) -> list[tuple[Index, Any, bool]] | None:
    """What ``process`` must write beyond `owned_slices` so that its own stores hold every
    slice its devices hold (a host-local fast tier's copy, `ckptstore.tiers.hostlocal`):
    addressable replicas whose replica 0 lives on another process (each index once) and,
    on processes other than 0, host values. None where that data is not at hand: a staged
    array (`HostShards`) staged without its ``extra`` pieces."""
    if isinstance(value, jax.Array):
        own = {_bounds(s.index, value.shape) for s in value.addressable_shards if s.replica_id == 0}
        out: dict[tuple[tuple[int, int], ...], tuple[Index, Any, bool]] = {}
        for shard in value.addressable_shards:
            key = _bounds(shard.index, value.shape)
            if key not in own and key not in out:
                out[key] = (tuple(shard.index), shard.data, True)
        return list(out.values())
    if isinstance(value, HostShards):
        if value.extra is None:
            return None
        return [(index, data, True) for index, data in value.extra]
    if process == 0:
        return []
    arr = host_array(value)
    return [(tuple(slice(None) for _ in arr.shape), arr, False)]


def addressable_indices(value: Any) -> list[Index] | None:
    """The regions of a leaf this process's devices hold (None: a host value, all of it)."""
    if isinstance(value, (jax.Array, HostShards)):
        indices = value.sharding.addressable_devices_indices_map(tuple(value.shape)).values()
        return [tuple(index or ()) for index in indices]
    return None


def _bounds(index: Index, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


Select = Callable[[Any, int], "list[tuple[Index, Any, bool]] | None"]


# ---- writing ----


async def write_store(
    backend: Backend, store: str, leaves: Sequence[tuple[LeafInfo, Any]], **options: Any
) -> WriteStats:
    """`write_leaves` into the OCDBT store at key ``store`` of ``backend`` (a process's
    store of an attempt or a part), with the backend's page-cache handling around it
    (`supports.write_behind`). ``options``: `write_leaves`' keyword arguments."""
    with supports.write_behind(backend, store):
        return await write_leaves(
            ocdbt_spec(backend.kvstore_spec(store), fresh=True),
            backend.ts_context,
            leaves,
            **options,
        )


async def write_leaves(
    store: dict[str, Any],
    context: ts.Context,
    leaves: Sequence[tuple[LeafInfo, Any]],
    *,
    process: int,
    write_metadata: bool,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    select: Select = owned_slices,
    packs: PackTarget | None = None,
    digests: dict[str, PieceTable] | None = None,
    chunk_plan: ChunkPlan | None = None,
) -> WriteStats:
    """Write this process's pieces of ``leaves`` into the OCDBT store ``store``.

    ``write_metadata`` makes this process write every leaf's ``zarr.json``
    (exactly one process should). At most ``max_inflight_bytes`` of shard data
    are handed to TensorStore at a time, which bounds the memory a save adds.
    ``select(value, process)`` picks the pieces (`owned_slices`; `host_view_slices`).
    With ``packs``, small single-chunk leaves go into packs there instead
    (`ckptstore.format.packs`; ``WriteStats.packed`` says where). With ``digests``,
    each piece written of a leaf not in it yet is digested as it is written
    (`ckptstore.format.digests`), into ``digests[leaf][piece bounds]``. With ``chunk_plan``
    (an incremental save), the chunks it says are held elsewhere are not written, and the
    chunk digests of what is digested are kept there (`ckptstore.datapath.chunkwrites`).
    """
    kv = await ts.KvStore.open(store, context=context)
    writer = LeafWriter(
        store,
        context,
        kv,
        process=process,
        write_metadata=write_metadata,
        budget=ByteBudget(max_inflight_bytes),
        select=select,
        packs=packs,
        digests=digests,
        chunk_plan=chunk_plan,
    )
    return await writer.write(leaves)


class LeafWriter:
    """One process's write of leaves into one OCDBT store (`write_leaves`).

    Big leaves go through TensorStore's zarr3 driver, a piece (shard) at a time
    (`big_leaf`, `piece`); small single-chunk leaves in groups, either as raw OCDBT keys
    (`small_leaves`: no TensorStore open per leaf) or into packs (`packed_leaves`). Every
    copy a write makes is held in ``budget`` until TensorStore has it written.
    """

    def __init__(
        self,
        store: dict[str, Any],
        context: ts.Context,
        kv: ts.KvStore,
        *,
        process: int,
        write_metadata: bool,
        budget: ByteBudget,
        select: Select,
        packs: PackTarget | None,
        digests: dict[str, PieceTable] | None,
        chunk_plan: ChunkPlan | None = None,
    ) -> None:
        self.store, self.context, self.kv = store, context, kv
        self.process, self.write_metadata = process, write_metadata
        self.budget, self.select, self.packs, self.digests = budget, select, packs, digests
        self.chunk_plan = chunk_plan or ChunkPlan()
        self.stats = WriteStats(process=process)
        self._encoding = asyncio.Lock()  # packs are encoded one at a time (see `write_pack`)

    async def write(self, leaves: Sequence[tuple[LeafInfo, Any]]) -> WriteStats:
        """Write every leaf; one failed write cancels (and awaits) the others before the
        error is raised, typed."""
        start = time.perf_counter()
        small = [(info, value) for info, value in leaves if chunks.small(info)]
        groups = chunks.groups(small, self.budget.limit // 4)
        smalls = (
            [self.small_leaves(group) for group in groups]
            if self.packs is None
            else [self.packed_leaves(k, group) for k, group in enumerate(groups)]
        )
        big = [self.big_leaf(info, value) for info, value in leaves if not chunks.small(info)]
        try:
            await gather_first_error([*big, *smalls])
        except Exception as exc:
            raise write_error(exc, "checkpoint data") from exc
        self.stats.seconds = time.perf_counter() - start
        return self.stats

    def pieces_of(self, value: Any) -> list[tuple[Index, Any, bool]]:
        pieces = self.select(value, self.process)
        if pieces is None:
            raise CkptStoreError("a staged leaf lacks the pieces this write needs")
        return pieces

    def table_for(self, info: LeafInfo) -> PieceTable | None:
        """The digest table this write fills for ``info`` (None: not digested here)."""
        if self.digests is None or info.name in self.digests:
            return None
        return self.digests.setdefault(info.name, {})

    def count(self, info: LeafInfo, nbytes: int) -> None:
        self.stats.leaves.append(info.name)
        self.stats.shards += 1
        self.stats.bytes += nbytes

    async def big_leaf(self, info: LeafInfo, value: Any) -> None:
        """A leaf of several chunks: its zarr.json (process 0) and its pieces."""
        pieces = self.pieces_of(value)
        if not pieces and not self.write_metadata:
            return
        declared = self.chunk_plan.declared.get(info.name)
        if declared is not None:
            await self.declared_leaf(info, pieces, declared)
            return
        held = self.chunk_plan.held.get(info.name)
        digested = self.digests is None or info.name in self.digests  # nothing to hash here
        batches = None
        if held and digested and chunks.known(info):  # None: a piece off the chunk grid
            batches = unheld_batches(pieces, info, held, self.budget.limit)
        if batches is not None:
            if pieces:
                self.stats.leaves.append(info.name)
            shards, nbytes = await write_in_part(
                self.kv, self.context, info, batches, self.budget, self.write_metadata
            )
            self.stats.shards += shards
            self.stats.bytes += nbytes
            return
        context, what = self.context, f"opening leaf {info.name!r}"
        meta: list[Any] = []
        if self.write_metadata and not chunks.known(info):  # TensorStore writes the zarr.json
            opening = ts.open(zarr_spec(self.store, info), create=True, context=context)
            arr = await finish_first(within(opening, context, 0, what))
        else:
            # The metadata comes from process 0, which writes it as one more key beside the
            # chunks: one OCDBT commit takes both, where `create=True` would commit the
            # zarr.json alone first (one more serial commit per save) before any chunk.
            opening = ts.open(
                zarr_spec(self.store, info), open=True, assume_metadata=True, context=context
            )
            arr = await within(opening, context, 0, what)
            if self.write_metadata:
                meta.append(self.metadata(info))
        if pieces:
            self.stats.leaves.append(info.name)
        table = self.table_for(info) if pieces else None  # no empty tables
        hashing = None
        if table is not None:  # chunk digests beside the piece digests
            chunk_table = self.chunk_plan.digests.setdefault(info.name, {})
            hashing = _Hashing(table, chunk_table, info.chunk_shape)
        if held:  # held elsewhere (an incremental save): digested already, not written
            pieces = unheld_pieces(pieces, info, held)
        writes = (self.piece(arr, *piece, table=hashing) for piece in pieces)
        await gather_first_error([*meta, *writes])

    async def declared_leaf(
        self, info: LeafInfo, pieces: list[tuple[Index, Any, bool]], declared: DeclaredLeaf
    ) -> None:
        """A leaf with declared rows: its changed chunks found while they are written, its
        digests and held chunks recorded in the chunk plan (`write_declared`)."""
        chunk_table: ChunkTable = {}
        done = await write_declared(
            self.kv,
            self.context,
            info,
            pieces,
            declared,
            chunk_table,
            max_inflight_bytes=self.budget.limit,
            write_metadata=self.write_metadata,
        )
        if pieces:
            self.stats.leaves.append(info.name)
            if self.digests is not None:
                self.digests[info.name] = done.table
            self.chunk_plan.digests[info.name] = chunk_table
            self.chunk_plan.held[info.name] = done.held
        self.stats.shards += done.written
        self.stats.bytes += done.nbytes

    async def metadata(self, info: LeafInfo) -> None:
        encoded = chunks.encode_metadata(info)
        write = self.kv.write(chunks.metadata_key(info), encoded)
        await finish_first(within(write, self.context, len(encoded), "writing metadata"))

    async def piece(
        self,
        arr: ts.TensorStore,
        index: Index,
        data: Any,
        private: bool,
        *,
        table: _Hashing | None = None,
    ) -> None:
        """One piece of a big leaf: written from its own memory where it is host memory,
        else copied to the host first within the budget."""
        nbytes = math.prod(sliced_shape(arr.shape, index)) * arr.dtype.numpy_dtype.itemsize
        view = data if private and isinstance(data, np.ndarray) else host_view(data)
        if view is not None:  # no copy: adds no memory, so it takes no share of the budget
            await self.written(arr, index, view, True, nbytes, table)
        else:
            async with self.budget.hold(nbytes):
                host = await off_loop(lambda: np.asarray(data), nbytes)  # device to host
                # A numpy leaf is the caller's array: TensorStore copies it.
                await self.written(arr, index, host, private, nbytes, table)
        self.stats.shards += 1
        self.stats.bytes += nbytes

    async def written(
        self,
        arr: ts.TensorStore,
        index: Index,
        host: Any,
        reference: bool,
        nbytes: int,
        hashing: _Hashing | None,
    ) -> None:
        """Write ``host`` at ``index``, digesting it meanwhile into ``hashing``."""
        write = arr[index].write(host, can_reference_source_data_indefinitely=reference)
        writing = finish_first(within(write, self.context, nbytes, "writing checkpoint data"))
        if hashing is None:
            await writing
            return
        shape = tuple(arr.shape)

        def run() -> tuple[str, ChunkTable]:
            return piece_digests(host, index, shape, hashing.chunk_shape)

        hexed, _ = await gather_first_error([off_loop(run, nbytes), writing])
        piece, chunk_table = hexed
        hashing.pieces[piece_key(index, shape)] = piece
        hashing.chunks.update(chunk_table)

    async def small_leaves(self, group: list[tuple[LeafInfo, Any]]) -> None:
        """Single-chunk leaves as raw OCDBT keys: at most one piece each (the whole array),
        no TensorStore open."""
        nbytes = sum(info.nbytes for info, _ in group)  # at most: some may not be ours
        owned: list[tuple[LeafInfo, list[tuple[Index, Any, bool]]]] = []
        policy = policy_of(self.context)
        limit = None if policy is None else policy.limit(nbytes)

        def encoded() -> Iterator[tuple[str, bytes]]:
            for info, pieces in owned:
                if self.write_metadata:
                    yield chunks.metadata_key(info), chunks.encode_metadata(info)
                table = self.table_for(info) if pieces else None  # no empty tables
                for index, data, _ in pieces:
                    host = np.asarray(data)
                    yield chunks.chunk_key(info), chunks.encode_chunk(info, host)
                    if table is not None:  # digested while its write runs
                        table[piece_key(index, info.shape)] = digest(host)

        def encode_and_write() -> None:
            # Shards, copies, checksums and TensorStore's copy of each value, all off the
            # loop; every write issued is waited for here (`write_keys`), so a cancelled
            # save (which waits for this thread) leaves none running behind it.
            owned.extend((info, self.pieces_of(value)) for info, value in group)
            write_keys(self.kv, encoded(), limit)

        async with self.budget.hold(nbytes):  # the encoded copies live until written
            await on_thread(None, encode_and_write)
        for info, pieces in owned:
            for _ in pieces:
                self.count(info, info.nbytes)

    async def packed_leaves(self, k: int, group: list[tuple[LeafInfo, Any]]) -> None:
        """Single-chunk leaves into pack ``k`` of `packs`, digested while it is written."""
        packs = self.packs
        assert packs is not None
        async with self.budget.hold(sum(info.nbytes for info, _ in group)):  # host copies
            indexed = [(info, p) for info, value in group for p in self.pieces_of(value)]
            if not indexed:
                return
            owned = [(info, data) for info, (_, data, _) in indexed]
            write = write_pack(
                packs.backend, packs.prefix, packs.key(k), owned, encoding=self._encoding
            )
            tables = [
                (self.table_for(info), piece_key(index, info.shape), data)
                for info, (index, data, _) in indexed
            ]
            if any(table is not None for table, _, _ in tables):

                def digest_all() -> list[str | None]:
                    return [digest(d) if t is not None else None for t, _, d in tables]

                # The digests (CPU) while the pack is written (mostly the disk's time).
                nbytes = sum(i.nbytes for i, _ in owned)
                wrote, hexes = await gather_first_error(
                    [finish_first(write), off_loop(digest_all, nbytes)]
                )
                refs = cast("list[PackRef]", wrote)
                for (table, key, _), hexed in zip(
                    tables, cast("list[str | None]", hexes), strict=True
                ):
                    if table is not None and hexed is not None:
                        table[key] = hexed
            else:
                refs = await finish_first(write)
            for (info, _), ref in zip(owned, refs, strict=True):
                self.stats.packed[info.name] = ref
                self.count(info, info.nbytes)


@dataclass(frozen=True)
class _Hashing:
    """Where a big leaf's digests go as its pieces are written: piece digests and their
    chunks' digests (`ckptstore.format.digests.piece_digests`)."""

    pieces: PieceTable
    chunks: ChunkTable
    chunk_shape: tuple[int, ...]


def host_view(data: Any) -> np.ndarray[Any, Any] | None:
    """A numpy view of a jax shard's own buffer when it lives in host memory, else None.

    On CPU devices `np.asarray` returns a read-only view of the (immutable) device
    buffer (of its first device, for a replicated array); TensorStore can encode from
    it directly, with no copy at all.
    """
    if not isinstance(data, jax.Array) or any(d.platform != "cpu" for d in data.devices()):
        return None
    host = np.asarray(data)
    try:
        first = data if len(data.devices()) == 1 else data.addressable_data(0)
        shared = host.size > 0 and host.ctypes.data == first.unsafe_buffer_pointer()
    except Exception:  # no buffer pointer on this platform
        return None
    return host if shared else None


def may_share_host_memory(value: jax.Array) -> bool:
    """Whether ``value``'s buffers may be a host buffer someone else can change: on CPU
    devices (or in a host memory kind) `jax.device_put` of a numpy array whose data is
    64-byte aligned does not copy, and the jax array then changes with the numpy one.
    Nothing in JAX tells such an array from one a computation made, so every array in
    host memory is taken to be one."""
    return _in_host_memory(value.sharding)


@functools.lru_cache(maxsize=1024)
def _in_host_memory(sharding: jax.sharding.Sharding) -> bool:
    devices = cast("set[jax.Device]", sharding.device_set)
    kind = getattr(sharding, "memory_kind", None)
    return kind in ("pinned_host", "unpinned_host") or any(d.platform == "cpu" for d in devices)


def _replicated_in_host_memory(value: jax.Array) -> bool:
    """Whether ``value`` is replicated over this process's CPU devices only: then the array
    itself is its one piece to write (`np.asarray` gives its first device's buffer), and
    no jax array per device is made; `addressable_shards` costs ~150 us for a leaf on 8
    devices the first time, most of describing a tree of thousands of small leaves."""
    return _host_replicated(value.sharding)


@functools.lru_cache(maxsize=1024)
def _host_replicated(sharding: jax.sharding.Sharding) -> bool:
    # Per sharding, not per array: the devices' platforms cost ~30 us a leaf to look up,
    # and the leaves of a tree share a few shardings.
    return (
        sharding.is_fully_replicated
        and sharding.is_fully_addressable
        and all(d.platform == "cpu" for d in cast("set[jax.Device]", sharding.device_set))
    )


def sliced_shape(shape: Sequence[int], index: Index) -> tuple[int, ...]:
    """The shape of the region ``index`` (step-1 slices) of an array of ``shape``."""
    return tuple(len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True))
