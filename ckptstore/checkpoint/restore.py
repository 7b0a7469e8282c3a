"""Finding committed steps and restoring trees from them, onto any mesh.

Restore is strict by default: every leaf the caller asks for must exist with
the same shape and dtype, and (unless `RestoreOptions` says ``partial``) every stored
leaf must be asked for. All disagreements are reported together in one
`TreeMismatchError`. Casting to another dtype is opt-in (``cast``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.backends.tsdeadline import within
from ckptstore.checkpoint.assemble import in_memory, restore_stored
from ckptstore.checkpoint.holdercheck import check_holders
from ckptstore.checkpoint.storeditem import Read, StoredItem, settle
from ckptstore.datapath import ocdbt_index
from ckptstore.datapath.chunkreads import RoutedChunks
from ckptstore.datapath.packs import read_packed, read_split
from ckptstore.datapath.rawleaf import RawLeaf
from ckptstore.datapath.reads import Chunks, KvChunks, open_leaf, read_small_leaves
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES, ocdbt_spec
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptstore.format import jsonitems, layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.leaves import (
    LeafInfo,
)
from ckptstore.format.manifest import Manifest
from ckptstore.format.packs import PackRef
from ckptstore.protocol import latest_manifest
from ckptstore.runtime import shortrepr
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.gcpause import gc_paused

# `asyncio.run(restore(...))` formats the restored tree with `reprlib` when it ends (Python
# 3.11, `ckptstore.runtime.shortrepr`): jax arrays there are described, never copied.
shortrepr.install()


@dataclass(frozen=True)
class RestoreOptions:
    """How a restore reads and checks the item it builds: the keywords of the public
    restores (`ckptstore.restore`, `CheckpointManager.restore`), gathered once there and
    passed down whole, so no layer between declares them again.

    ``item``: which item of the step. ``partial``: leaves stored but not in ``like`` are
    allowed. ``cast``: leaves may be cast to ``like``'s dtypes. ``max_inflight_bytes``: read
    data waiting for their devices at a time (one slice larger than that is read alone).
    """

    item: str = layout.DEFAULT_ITEM
    partial: bool = False
    cast: bool = False
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES


async def restore(backend: Backend, step: int | None, like: Any, options: RestoreOptions) -> Any:
    """Restore committed ``step`` (the latest when None) of ``backend``, as ``options`` say.

    ``like`` describes what to build: ``None`` gives the saved tree with numpy
    arrays; a tree of `jax.ShapeDtypeStruct` (or arrays) with shardings gives
    jax arrays laid out that way, each process reading only its slices. Typed PRNG
    keys come back as typed keys of their saved implementation either way.
    """
    # Thousands of long-lived objects for a tree of thousands of leaves, none of them
    # garbage: the cyclic collector waits (`ckptstore.runtime.gcpause`).
    with gc_paused():
        return await restore_item(await open_stored(backend, step, options.item), like, options)


async def restore_item(stored: StoredItem | JsonItem, like: Any, options: RestoreOptions) -> Any:
    """The tree ``like`` describes, from ``stored`` (an item the caller opened: of a
    committed step, or of an Orbax checkpoint, `ckptstore.api`), checked and read as
    ``options`` say."""
    with gc_paused():
        if isinstance(stored, JsonItem):  # configuration: JSON in the manifest
            return jsonitems.restore(stored, like)
        budget = ByteBudget(options.max_inflight_bytes)
        return await restore_stored(
            stored, like, partial=options.partial, cast=options.cast, budget=budget
        )


async def restore_manifest(
    backend: Backend, manifest: Manifest, like: Any, options: RestoreOptions
) -> Any:
    """`restore` of the attempt ``manifest`` describes (verified by the caller), from the
    stores on ``backend`` (a host-local fast tier's own copy: `hostlocal`)."""
    with gc_paused():
        stored = await open_manifest_item(backend, manifest, options.item)
        return await restore_item(stored, like, options)


async def open_stored(backend: Backend, step: int | None, item: str) -> StoredItem | JsonItem:
    """Item ``item`` of committed ``step`` (the latest when None): its arrays, or a JSON item."""
    return await open_manifest_item(backend, await latest_manifest(backend, step), item)


async def open_manifest_item(
    backend: Backend, manifest: Manifest, item: str
) -> StoredItem | JsonItem:
    """Item ``item`` of the attempt ``manifest`` describes: a JSON item, or its arrays."""
    if item in manifest.json_items:
        return manifest.json_items[item]
    return await manifest_item(backend, manifest, item)


async def manifest_item(backend: Backend, manifest: Manifest, item: str) -> StoredItem:
    """Item ``item`` of the attempt ``manifest`` describes, read from ``backend``; a leaf
    another attempt holds (an incremental save's reference) is read from that attempt."""
    if item not in manifest.items:
        raise CheckpointNotFoundError(
            f"step {manifest.step} has no item {item!r} (it has {manifest.item_names})",
            backend=backend.url,
        )
    saved = manifest.items[item]
    await check_holders(backend, manifest, item)  # what it references: the holders agree
    home = manifest.item_dir(item)  # most leaves' directory: worked out once, not per leaf
    where = {n: manifest.leaf_dir(item, n) if n in saved.refs else home for n in saved.leaves}
    in_part = {n: manifest.holder_dirs(item, n) for n in saved.chunk_refs}
    # An incremental step's leaves can lie in several attempts: their stores (each an
    # index to load) are opened together, not one after another.
    held = [d for dirs in in_part.values() for d in dirs.values()]
    prefixes = list(dict.fromkeys([*where.values(), *held]))
    opened = await settle(_Reader.open(backend, p, saved.packed) for p in prefixes)
    readers = dict(zip(prefixes, opened, strict=True))

    def routed(info: LeafInfo) -> RoutedChunks:
        """The chunks of a leaf held in part, each from the store of its holder."""
        holders = {k: readers[d].source for k, d in in_part[info.name].items()}
        return RoutedChunks(info, readers[home].source, holders, saved.chunk_refs[info.name])

    def split(infos: Sequence[LeafInfo]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for k, info in enumerate(infos):
            groups.setdefault(where[info.name], []).append(k)
        return groups

    async def open_native(info: LeafInfo) -> ts.TensorStore:
        if info.name in in_part:  # no one zarr3 array has all its chunks: read it whole
            return ts.array(await (await _read_in_part(routed(info), info))(()))
        return await readers[where[info.name]].open_native(info)

    async def read_small(infos: Sequence[LeafInfo]) -> list[np.ndarray[Any, Any]]:
        out: list[Any] = [None] * len(infos)
        groups = list(split(infos).items())
        found = await settle(readers[p].read_small([infos[k] for k in ks]) for p, ks in groups)
        for (_, ks), values in zip(groups, found, strict=True):
            for k, value in zip(ks, values, strict=True):
                out[k] = value
        return out

    async def open_raw(infos: Sequence[LeafInfo]) -> list[Read | None]:
        out: list[Read | None] = [None] * len(infos)
        for k, info in enumerate(infos):
            if info.name in in_part:
                out[k] = await _read_in_part(routed(info), info)
        rest = [k for k, info in enumerate(infos) if info.name not in in_part]
        groups = list(split([infos[k] for k in rest]).items())
        found = await settle(readers[p].open_raw([infos[rest[j]] for j in js]) for p, js in groups)
        for (_, js), reads in zip(groups, found, strict=True):
            for j, read in zip(js, reads, strict=True):
                out[rest[j]] = read
        return out

    return StoredItem(saved.leaves, saved.structure, open_native, read_small, open_raw)


async def _read_in_part(source: RoutedChunks, info: LeafInfo) -> RawLeaf:
    """The reader of a leaf held in part (chunk references): chunk by chunk, each from its
    holder's store. Only leaves whose ``zarr.json`` is what a save writes are saved so."""
    raw = await RawLeaf.open(source, info)
    if raw is None:
        raise CorruptCheckpointError(
            "the zarr.json of a leaf held in part by other attempts is not what a save writes",
            leaf=info.name,
        )
    return raw


@dataclass(frozen=True)
class _Reader:
    """The leaves of one item's directory (an attempt's merged store and packs)."""

    backend: Backend
    prefix: str
    store: dict[str, Any]
    source: Chunks
    packed: Mapping[str, PackRef]

    @classmethod
    async def open(cls, backend: Backend, prefix: str, packed: Mapping[str, PackRef]) -> _Reader:
        store = ocdbt_spec(backend.kvstore_spec(prefix))
        source = await chunk_source_at(backend, prefix, store)
        return cls(backend, prefix, store, source, packed)

    async def unpack(self, info: LeafInfo) -> np.ndarray[Any, Any]:
        (whole,) = await read_packed(self.backend, self.prefix, [(info, self.packed[info.name])])
        return whole

    async def open_native(self, info: LeafInfo) -> ts.TensorStore:
        if info.name in self.packed:  # an array in memory, for readers that want TensorStore's
            return ts.array(await self.unpack(info))
        return await open_leaf(self.store, self.backend.ts_context, info)

    async def read_small(self, infos: Sequence[LeafInfo]) -> list[np.ndarray[Any, Any]]:
        async def others(rest: list[LeafInfo]) -> list[np.ndarray[Any, Any]]:
            return await read_small_leaves(self.source, self.store, self.backend.ts_context, rest)

        return await read_split(self.backend, self.prefix, self.packed, infos, others)

    async def open_raw(self, infos: Sequence[LeafInfo]) -> list[Read | None]:
        unpacked = [i for i in infos if i.name not in self.packed]
        raws = iter(await RawLeaf.open_many(self.source, unpacked))
        return [
            in_memory(await self.unpack(info)) if info.name in self.packed else next(raws)
            for info in infos
        ]


async def chunk_source_at(backend: Backend, prefix: str, store: dict[str, Any]) -> Chunks:
    """Where the chunk bytes of the merged store ``store`` at ``prefix`` are read from: its
    data files directly where `direct_chunks` can, else TensorStore's kvstore."""
    direct = await direct_chunks(backend, prefix)
    if direct is not None:
        return direct
    opening = ts.KvStore.open(store, context=backend.ts_context)
    kv = await within(opening, backend.ts_context, 0, f"opening {prefix!r}")
    return KvChunks(kv, backend.ts_context)


async def direct_chunks(backend: Backend, prefix: str) -> Chunks | None:
    """The merged store at ``prefix`` read straight from its data files into buffers, where
    the backend reads cheaply into buffers and the store's index is understood; else None
    (read through TensorStore's kvstore)."""
    if not backend.capabilities.direct_reads:
        return None
    ctx = backend.ts_context
    opening = ts.KvStore.open(backend.kvstore_spec(prefix), context=ctx)
    base = await within(opening, ctx, 0, f"opening {prefix!r}")
    index = await ocdbt_index.load(base)
    return None if index is None else ocdbt_index.DirectChunks(backend, prefix, index)
