"""Chunk-level incremental saves: a changed leaf writes only the chunks that changed.

`ckptstore.checkpoint.incremental` references a leaf whole when every piece is unchanged.
A leaf that changed in some chunks only is, where the base recorded its chunk digests
(`ckptstore.format.chunkrefs`) and its shape, dtype and chunk shape are the base's, written
chunk by chunk: each process compares the digests of the chunks it owns with the base's
and leaves out the equal ones (`ckptstore.datapath.chunkwrites`). A chunk has exactly one
owner process, so that decision is the owner's alone; no round is needed for it.

Each process records, beside its store, its chunks' digests and which of them it left out
(`write_records`, ``chunks.json``; process 0 keeps its own in memory:
`ckptstore.checkpoint.writerrecords`); process 0 reads them (`read_records`) and puts into the
manifest each such leaf's chunk digests and, per holder attempt, the ranges of chunks it
holds (`item_chunks`): the base's holder of that chunk, never the base when the base itself
referenced it (no chains). The model and its safety argument: docs/incremental.md,
"Chunk references".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptstore.backends.base import Backend
from ckptstore.datapath.chunkwrites import ChunkPlan
from ckptstore.errors import CkptStoreError
from ckptstore.format import chunks
from ckptstore.format.chunkrefs import HEX, ChunkRefs, encode_digests
from ckptstore.format.digests import (
    ChunkTable,
    are_digests,
    chunk_count,
    chunk_region,
    chunks_size,
    is_digest,
)
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.runtime.gcpause import gc_paused

if TYPE_CHECKING:  # `incremental` uses this module: its types only, not an import cycle
    from ckptstore.checkpoint.incremental import Base, References

#: A writer's chunk records, beside its store: ``{leaf: {"digests": {k: hex}, "held": [k]}}``.
RECORDS = "chunks.json"


def base_chunk_digests(base: Base, item: str, info: LeafInfo) -> str | None:
    """The base's chunk digests of ``info``'s leaf, if a chunk-level save may compare with
    them: the base stored the leaf in the same form with comparable digests, and its dtype
    takes the raw read path (`chunks.known`), which assembles a leaf from several stores."""
    if not chunks.known(info) or base.table(item, info) is None:
        return None
    return base.manifest.items[item].chunk_digests.get(info.name)


def held_chunks(recorded: str, mine: ChunkTable) -> set[int]:
    """The chunks of ``mine`` whose digest is the base's (``recorded``), compared all at
    once (a table has thousands)."""
    keys = np.fromiter(mine.keys(), np.int64, len(mine))
    ours = np.frombuffer("".join(mine.values()).encode("ascii"), f"S{HEX}")
    theirs = np.frombuffer(recorded.encode("ascii"), f"S{HEX}")
    inside = keys < theirs.size
    same = np.zeros(keys.size, np.bool_)
    same[inside] = theirs[keys[inside]] == ours[inside]
    return set(keys[same].tolist())


def plan_chunks(plan: ChunkPlan, base: Base, item: str, info: LeafInfo, table: ChunkTable) -> None:
    """Keep this process's chunk digests of ``info``'s leaf in ``plan``, and which of its
    chunks equal the base's (left out where the leaf is not referenced whole)."""
    if not table:
        return
    plan.digests[info.name] = table
    recorded = base_chunk_digests(base, item, info)
    if recorded is not None:
        plan.held[info.name] = held_chunks(recorded, table)


@dataclass
class Records:
    """Every process's chunk records of one item, joined: per leaf, chunk digests and the
    chunks left out (held by the base's holders)."""

    digests: dict[str, ChunkTable] = field(default_factory=dict)
    held: dict[str, set[int]] = field(default_factory=dict)

    def add(self, digests: Mapping[str, ChunkTable], held: Mapping[str, Set[int]]) -> None:
        """Join one writer's records: its chunk digests per leaf and the chunks it left out
        (the leaves without digests have no record, as `write_records` writes them)."""
        for leaf, table in digests.items():
            if table:
                self.digests.setdefault(leaf, {}).update(table)
                self.held.setdefault(leaf, set()).update(held.get(leaf, ()))


async def write_records(
    backend: Backend, store: str, digests: Mapping[str, ChunkTable], held: Mapping[str, Set[int]]
) -> int:
    """Write one writer's chunk records beside its store (`RECORDS`); for how many leaves
    (none: nothing is written)."""
    with gc_paused():
        doc = {
            leaf: {
                "digests": {str(k): h for k, h in table.items()},
                "held": sorted(held.get(leaf, ())),
            }
            for leaf, table in digests.items()
            if table
        }
        if not doc:
            return 0
        data = json.dumps(doc, separators=(",", ":")).encode()
    await backend.write(f"{store}/{RECORDS}", data)
    return len(doc)


async def read_records(backend: Backend, stores: Sequence[str]) -> Records:
    """The chunk records written beside each of ``stores``, joined per leaf;
    `CkptStoreError` if one is unreadable."""
    out = Records()
    for store in stores:
        key = f"{store}/{RECORDS}"
        try:
            with gc_paused():
                doc = json.loads(await backend.read(key))
                if not isinstance(doc, dict):
                    raise ValueError("not a JSON object")
                for leaf, record in doc.items():
                    table = _chunk_table(leaf, record["digests"])
                    held = record["held"]
                    if not isinstance(held, list) or not all(isinstance(k, int) for k in held):
                        raise ValueError(f"leaf {leaf!r}: bad held chunks")
                    out.digests.setdefault(leaf, {}).update(table)
                    out.held.setdefault(leaf, set()).update(held)
        except (ValueError, KeyError, TypeError) as exc:
            raise CkptStoreError(f"unreadable chunk records {key}: {exc}") from exc
    return out


@dataclass
class ItemChunks:
    """What the manifest records of one item's chunks (`ItemManifest.chunk_digests`,
    ``chunk_refs``), and the regions the merge must find written for the leaves held in
    part (only their written chunks are in this attempt)."""

    digests: dict[str, str] = field(default_factory=dict)
    refs: dict[str, ChunkRefs] = field(default_factory=dict)
    regions: dict[str, Sequence[Index] | None] = field(default_factory=dict)


def item_chunks(
    base: Base | None,
    item: str,
    infos: Sequence[LeafInfo],
    records: Records,
    whole: Set[str],
    references: References,
) -> ItemChunks:
    """Process 0: the chunk records of ``item`` for its manifest. ``whole``: leaves held
    whole by the base's holders (their chunk digests are the base's)."""
    out = ItemChunks()
    for info in infos:
        n = chunk_count(info.shape, info.chunk_shape)
        if n <= 1:
            continue
        if info.name in whole:  # unchanged: the base's record, holders and all
            assert base is not None
            text = base.manifest.items[item].chunk_digests.get(info.name)
            if text is not None:
                out.digests[info.name] = text
            if info.name in base.in_part(item):  # every chunk held, as the base's were
                every = np.arange(n, dtype=np.int64)
                out.refs[info.name] = _held_refs(base, item, info.name, every, references)
            continue
        text = encode_digests(records.digests.get(info.name, {}), n)
        if text is not None:
            out.digests[info.name] = text
        held = records.held.get(info.name)
        if not held:
            continue
        if base is None or text is None:  # a process left chunks out it had no digests of
            raise CkptStoreError(f"leaf {info.name!r}: chunks left out without a base's record")
        linears = np.sort(np.fromiter(held, np.int64, len(held)))
        out.refs[info.name] = _held_refs(base, item, info.name, linears, references)
        written = np.setdiff1d(np.arange(n, dtype=np.int64), linears, assume_unique=True)
        out.regions[info.name] = [
            chunk_region(k, info.shape, info.chunk_shape) for k in written.tolist()
        ]
    return out


def _held_refs(
    base: Base,
    item: str,
    leaf: str,
    linears: np.ndarray[Any, np.dtype[np.int64]],
    references: References,
) -> ChunkRefs:
    """The chunk references of the chunks ``linears`` (ascending) of ``leaf``, each to
    the attempt holding it as the base stored it (never the base where it referenced
    them: no chains), numbered in ``references``."""
    holders = np.empty(linears.size, np.int64)
    for ref, mask in base.chunk_holders(item, leaf, linears):
        holders[mask] = references.index(ref)
    return ChunkRefs.of_arrays(linears, holders)


def held_bytes(infos: Sequence[LeafInfo], held: Mapping[str, Set[int]]) -> int:
    """Payload bytes of the chunks ``held`` names (per leaf, linear chunk indices)."""
    return sum(
        chunks_size(held[info.name], info.shape, info.chunk_shape) * dtype_of(info.dtype).itemsize
        for info in infos
        if held.get(info.name)
    )


def _chunk_table(leaf: str, doc: Any) -> ChunkTable:
    """A chunk record's digests (``{"<linear index>": hex}``), checked; ValueError."""
    if not isinstance(doc, dict):
        raise ValueError(f"leaf {leaf!r}: bad chunk digests")
    if all(isinstance(k, str) and k.isdigit() for k in doc) and are_digests(doc.values()):
        return {int(k): v for k, v in doc.items()}
    for key, value in doc.items():  # which one: an error names it
        if not (isinstance(key, str) and key.isdigit() and is_digest(value)):
            raise ValueError(f"leaf {leaf!r}: bad chunk digest {str(key)[:20]!r}")
    raise AssertionError("unreachable: are_digests and is_digest disagree")
