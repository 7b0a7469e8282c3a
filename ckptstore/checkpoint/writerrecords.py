"""What each process records beside its store of an item, for process 0's manifest.

A process's piece digests (`incremental.write_digests`, ``digests.json``), chunk records
(`chunklevel.write_records`, ``chunks.json``) and pack index (`packs.write_index`,
``packs.json``) are how it tells process 0 what it wrote: the other processes write them
beside their stores and process 0 reads them (`collect`, `saveplan.packed_leaves`).
Process 0 makes the manifest itself, so it keeps its own in memory (`Beside`), neither
written nor read back: three files and their reads less on every save (about 7 ms of a
one-process chunk-level save's 60, docs/benchmarks.md; on object storage two serial round
trips of a small save, docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.chunklevel import Records, read_records, write_records
from ckptstore.checkpoint.incremental import read_digests, write_digests
from ckptstore.datapath.chunkwrites import ChunkPlan
from ckptstore.datapath.packs import write_index
from ckptstore.format.digests import PieceTable
from ckptstore.format.packs import PackRef
from ckptstore.runtime.futures import gather_first_error


@dataclass(frozen=True)
class Beside:
    """One process's records of its store of one item: its piece digests per leaf (None:
    none recorded), its chunk-level plan (chunk digests, the chunks it left out) and where
    its packed leaves lie."""

    tables: dict[str, PieceTable] | None
    plan: ChunkPlan
    packed: dict[str, PackRef] = field(default_factory=dict)

    def digested(self) -> int:
        """For how many leaves there are piece digests (what `write_digests` counts)."""
        return sum(1 for table in (self.tables or {}).values() if table)

    def chunked(self) -> int:
        """For how many leaves there are chunk records (what `write_records` counts)."""
        return sum(1 for table in self.plan.digests.values() if table)


async def record(backend: Backend, store: str, beside: Beside, *, keep: bool) -> tuple[int, int]:
    """Write ``beside`` next to ``store``, unless ``keep`` (process 0 keeps its own);
    for how many leaves there are piece digests and chunk records."""
    if keep:
        return beside.digested(), beside.chunked()
    written: list[Awaitable[Any]] = [
        write_records(backend, store, beside.plan.digests, beside.plan.held)
    ]
    if beside.tables is not None:
        written.append(write_digests(backend, store, beside.tables))
    if beside.packed:
        written.append(write_index(backend, store, beside.packed))
    counts = await gather_first_error(written)
    return (counts[1] if beside.tables is not None else 0), counts[0]


async def collect(
    backend: Backend,
    digested: Sequence[str],
    chunked: Sequence[str],
    kept: Beside | None,
) -> tuple[dict[str, PieceTable], Records]:
    """Process 0: every process's piece digests and chunk records of one item, joined per
    leaf: those written beside the stores ``digested`` and ``chunked`` (the other
    processes'), and its own ``kept`` in memory (None: it wrote no store of the item)."""
    tables = await read_digests(backend, digested)
    records = await read_records(backend, chunked)
    if kept is not None:
        for leaf, table in (kept.tables or {}).items():
            if table:
                tables.setdefault(leaf, {}).update(table)
        records.add(kept.plan.digests, kept.plan.held)
    return tables, records
