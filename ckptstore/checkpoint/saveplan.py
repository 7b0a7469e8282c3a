"""A save's plan for the commit engine (`ckptstore.checkpoint.engine`): on process 0, what
the writers recorded, joined; then the merge and the manifest.

1. `joined` (`SavePlan.join`, while the engine claims the fate): reads and arithmetic only,
   nothing written. Per item: the leaves each process packed, the piece digests and chunk
   records beside the stores (process 0's own kept in memory: `ckptstore.checkpoint.writerrecords`),
   the chunk references of leaves held in part, and the references of leaves held whole by
   the base's holders.
2. `merged` (`SavePlan.merge`, the fate claimed for the commit): each item's stores merged by
   reference into its store (where the hooks merge here), its packs checked, and the
   attempt's manifest with every leaf, digest and reference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.chunklevel import ItemChunks, item_chunks
from ckptstore.checkpoint.incremental import Base, References, Unchanged
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.writerrecords import Beside, collect
from ckptstore.datapath.packs import check_packs, read_index
from ckptstore.errors import CkptStoreError
from ckptstore.format import layout
from ckptstore.format.digests import PieceTable
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import ItemManifest, Manifest, needed_version
from ckptstore.format.packs import PackRef
from ckptstore.runtime.futures import gather_first_error

if TYPE_CHECKING:  # `save` makes the plan: its types only, not an import cycle
    from ckptstore.checkpoint.save import ProcessReport, SaveRequest


@dataclass
class ItemRecords:
    """One item's part of the manifest, known before its merge (`joined`)."""

    stores: list[str]  # every process's store of the item, by process
    packed: dict[str, PackRef]  # every packed leaf's pack, in this attempt or its holder's
    own_packs: list[tuple[LeafInfo, PackRef]]  # the packs this attempt wrote, to check
    digests: dict[str, PieceTable]
    chunks: ItemChunks
    refs: dict[str, int]  # leaves held whole by another attempt -> reference index
    unpacked: list[LeafInfo]  # the leaves the merge must find in the stores


@dataclass
class Joined:
    """What `joined` returns: every item's `ItemRecords`, and the attempts they reference,
    in order (not `chunklevel.Records`, one item's chunk records)."""

    items: dict[str, ItemRecords]
    references: References
    base: Base | None  # the base step of an incremental save


@dataclass
class SavePlan:
    """The engine's `Plan` of a save: its request, attempt, references (``same``), every
    process's report and process 0's own records (``kept``); ``written``: when phase 2
    ended (`time.perf_counter`), for the manifest's timings."""

    request: SaveRequest
    where: layout.AttemptDir
    same: Unchanged
    reports: Sequence[ProcessReport]
    kept: dict[str, Beside]
    written: float
    records: Joined | None = None

    async def join(self) -> None:
        self.records = await joined(self.request, self.where, self.same, self.reports, self.kept)

    async def merge(self) -> Manifest:
        assert self.records is not None, "merge before join"
        return await merged(self.request, self.where, self.reports, self.written, self.records)


async def joined(
    request: SaveRequest,
    where: layout.AttemptDir,
    same: Unchanged,
    reports: Sequence[ProcessReport],
    kept: dict[str, Beside],
) -> Joined:
    """Step 1: every item's records (nothing is written)."""
    backend, based = request.backend, same.base
    references = References([])
    out: dict[str, ItemRecords] = {}
    for name, item in request.items.items():
        stores = [where.process_store(name, i) for i in range(len(reports))]
        packed = await packed_leaves(backend, where, name, item.leaves, reports, kept.get(name))
        infos = {info.name: info for info in item.leaves}
        own_packs = [(infos[n], ref) for n, ref in packed.items()]
        held = same.leaves.get(name, set())  # by the base's holders: not in this attempt
        # A host-local fast tier holds only process 0's store here: the others' digests
        # stay on their hosts, and this step serves as a base for process 0's pieces only.
        others = reports[1:] if request.hooks.merge else []
        digests, chunked = await collect(
            backend,
            [stores[r.process] for r in others if r.digested.get(name)],
            [stores[r.process] for r in others if r.chunked.get(name)],
            kept.get(name),
        )
        # Leaves held in part: the chunks the base's holders have are not in this attempt.
        in_part = item_chunks(based, name, item.leaves, chunked, held, references)
        refs: dict[str, int] = {}
        for leaf in sorted(held - in_part.refs.keys()):  # held in part by the base: chunks
            assert based is not None
            refs[leaf] = references.index(based.holder(name, leaf))
            digests[leaf] = based.digests(name, leaf)
            ref = based.packed(name, leaf)
            if ref is not None:  # in its holder's pack, which the reference names
                packed[leaf] = ref
        unpacked = [i for i in item.leaves if i.name not in packed and i.name not in held]
        out[name] = ItemRecords(stores, packed, own_packs, digests, in_part, refs, unpacked)
    return Joined(out, references, based)


async def merged(
    request: SaveRequest,
    where: layout.AttemptDir,
    reports: Sequence[ProcessReport],
    written: float,
    records: Joined,
) -> Manifest:
    """Step 2, the fate claimed: each item's stores merged (where the hooks merge here) and
    its packs checked; the attempt's manifest (``written``: when phase 2 ended, by
    `time.perf_counter`, for its timings)."""
    backend = request.backend
    manifest_items = {}
    for name, item in request.items.items():
        mine = records.items[name]
        infos = {info.name: info for info in item.leaves}
        if request.hooks.merge:  # the packs checked while the stores merge: no order needed
            await gather_first_error(
                [
                    merge(
                        backend,
                        where.item(name),
                        mine.stores,
                        mine.unpacked,
                        regions=mine.chunks.regions,
                        fresh=True,
                    ),
                    check_packs(backend, where.item(name), mine.own_packs),
                ]
            )
        manifest_items[name] = ItemManifest(
            structure=item.structure,
            leaves=infos,
            parts=[store_name(s) for s in mine.stores],
            packed={i.name: mine.packed[i.name] for i in item.leaves if i.name in mine.packed},
            digests={i.name: mine.digests[i.name] for i in item.leaves if i.name in mine.digests},
            refs=mine.refs,
            chunk_digests=mine.chunks.digests,
            chunk_refs=mine.chunks.refs,
        )
    holders, based = records.references.holders, records.base
    return Manifest(
        step=request.step,
        attempt=where.attempt,
        items=manifest_items,
        processes=[report.written() for report in reports],
        metadata=request.metadata or {},
        json_items=request.configs or {},
        references=holders,
        base=based.ref if based is not None and holders else None,
        format_version=needed_version(manifest_items, bool(holders)),
        timings={
            **request.timings,
            "write": max(report.seconds for report in reports),
            "merge": time.perf_counter() - written,
        },
    )


async def packed_leaves(
    backend: Backend,
    where: layout.AttemptDir,
    item: str,
    leaves: Sequence[LeafInfo],
    reports: Sequence[ProcessReport],
    kept: Beside | None,
) -> dict[str, PackRef]:
    """Every process's packed leaves of ``item`` (from the index each wrote beside its
    packs; process 0's ``kept`` in memory), in the saved leaves' order. A leaf two
    processes packed, or one the tree does not have, is a bug worth stopping the save for."""
    found: dict[str, PackRef] = {}
    for i, report in enumerate(reports):
        if not report.packed.get(item):
            continue
        if i == 0 and kept is not None:
            index = kept.packed
        else:
            index = await read_index(backend, where.process_store(item, i))
        for leaf, ref in index.items():
            if leaf in found:
                raise CkptStoreError(f"leaf {leaf!r} was packed by two processes")
            found[leaf] = ref
    out = {info.name: found.pop(info.name) for info in leaves if info.name in found}
    if found:
        raise CkptStoreError(f"packed leaves the tree does not have: {sorted(found)[:5]}")
    return out


def store_name(key: str) -> str:
    """The last part of a store's key (its name in its item's directory)."""
    return key.rsplit("/", 1)[1]
