"""What a write does differently for chunk-level incremental saves: chunks it leaves out.

A leaf some of whose chunks the base step holds unchanged (`ckptstore.format.chunkrefs`)
is written chunk by chunk: of each piece this process owns, only the chunks not held
elsewhere. A piece with none held is written whole as ever, and one with all held not
at all. The chunk digests of what a write digests are kept in `ChunkPlan.digests`, beside
the piece digests, for the manifest.

Where the leaf's stored form is one this version writes itself (`chunks.known`), its
chunks go as raw OCDBT keys (`unheld_chunks`, encoded as `chunks.encode_chunk`): one batch
of key writes, where TensorStore's zarr3 driver would take a write per chunk and an open.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from ckptstore.backends.tsdeadline import policy_of
from ckptstore.datapath.declaredwrites import DeclaredLeaf
from ckptstore.datapath.regions import read_regions
from ckptstore.format import chunks
from ckptstore.format.digests import (
    ChunkTable,
    chunk_grid,
    piece_chunks,
    piece_linears,
    regions_in_piece,
)
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.futures import gather_first_error, on_thread, write_keys


@dataclass
class ChunkPlan:
    """One process's chunk-level part of a write: per leaf, the chunks it must not write
    (``held``: linear chunk indices another attempt holds), and the chunk digests of its
    pieces (``digests``: filled by the write for the leaves it digests). The leaves in
    ``declared`` are found out chunk by chunk while they are written
    (`ckptstore.datapath.declaredwrites`): the write fills their ``held`` and ``digests``."""

    held: dict[str, set[int]] = field(default_factory=dict)
    digests: dict[str, ChunkTable] = field(default_factory=dict)
    declared: dict[str, DeclaredLeaf] = field(default_factory=dict)


def unheld_pieces(
    pieces: list[tuple[Index, Any, bool]], info: LeafInfo, held: Set[int]
) -> list[tuple[Index, Any, bool]]:
    """``pieces`` without the chunks in ``held``: a piece none of whose chunks is held as it
    is; one with some held, as one piece per chunk to write (views of its host data)."""
    out: list[tuple[Index, Any, bool]] = []
    for index, data, private in pieces:
        covered = piece_chunks(index, info.shape, info.chunk_shape)
        if covered is None or not any(linear in held for linear, _ in covered):
            out.append((index, data, private))
            continue
        host = data if isinstance(data, np.ndarray) else np.asarray(data)
        starts = [s.indices(n)[0] for s, n in zip(index, info.shape, strict=True)]
        for linear, rel in covered:
            if linear in held:
                continue
            absolute = tuple(
                slice(a + r.start, a + r.stop) for a, r in zip(starts, rel, strict=True)
            )
            out.append((absolute, host[rel], private))
    return out


#: A piece to write in part, with the linear indices of the chunks of it to write.
Unheld = tuple[tuple[Index, Any, bool], np.ndarray[Any, np.dtype[np.int64]]]


def unheld_batches(
    pieces: Sequence[tuple[Index, Any, bool]], info: LeafInfo, held: Set[int], limit: int
) -> list[tuple[list[Unheld], int]] | None:
    """``pieces`` with the chunks of each not in ``held``, in batches of at most ``limit``
    bytes of those chunks (a piece larger alone is a batch of its own), each with those
    bytes; pieces with none such are left out, and with no batch at all one empty batch
    remains (process 0 still writes the leaf's zarr.json). None if a piece is not on the
    chunk grid (then the leaf is written through TensorStore, `unheld_pieces`)."""
    taken = np.fromiter(held, np.int64, len(held))
    size = math.prod(info.chunk_shape) * dtype_of(info.dtype).itemsize
    out: list[tuple[list[Unheld], int]] = []
    batch: list[Unheld] = []
    total = 0
    for piece in pieces:
        linears = piece_linears(piece[0], info.shape, info.chunk_shape)
        if linears is None:
            return None
        todo = linears[~np.isin(linears, taken)]
        if not todo.size:
            continue
        nbytes = int(todo.size) * size
        if batch and total + nbytes > limit:
            out.append((batch, total))
            batch, total = [], 0
        batch.append((piece, todo))
        total += nbytes
    if batch or not out:
        out.append((batch, total))
    return out


def unheld_chunks(
    index: Index, data: Any, info: LeafInfo, todo: np.ndarray[Any, np.dtype[np.int64]]
) -> list[tuple[tuple[int, ...], np.ndarray[Any, Any], int]]:
    """The chunks ``todo`` (linear indices, as `unheld_batches` gives them) of the piece
    ``index`` holding ``data``: each one's grid coordinates, its region of the leaf (an edge
    chunk's smaller than the chunk shape: `chunks.encode_region` pads it) and its element
    count."""
    grid = chunk_grid(info.shape, info.chunk_shape)
    linears = todo.tolist()
    rels = regions_in_piece(todo, index, info.shape, info.chunk_shape)
    out = []
    # On an accelerator only these chunks are copied to the host, not the piece.
    for linear, rel, part in zip(linears, rels, read_regions(data, rels), strict=True):
        coord = tuple(int(k) for k in np.unravel_index(linear, grid))
        out.append((coord, part, math.prod(r.stop - r.start for r in rel)))
    return out


async def write_in_part(
    kv: ts.KvStore,
    context: ts.Context,
    info: LeafInfo,
    batches: Sequence[tuple[Sequence[Unheld], int]],
    budget: ByteBudget,
    write_metadata: bool,
) -> tuple[int, int]:
    """A leaf held in part, in a stored form this version writes itself (`chunks.known`):
    its zarr.json (``write_metadata``: process 0) and the chunks ``batches`` names
    (`unheld_batches`, of at most the budget's bytes each) as raw OCDBT keys into ``kv``,
    no TensorStore open, each batch one OCDBT commit (`write_keys`). How many chunks it
    wrote, and their payload bytes."""
    itemsize = dtype_of(info.dtype).itemsize
    policy = policy_of(context)
    written = [0, 0]

    async def one(batch: Sequence[Unheld], nbytes: int, meta: bool) -> None:
        limit = None if policy is None else policy.limit(nbytes)
        sizes: list[int] = []

        def encoded() -> Iterator[tuple[str, bytes]]:
            if meta:
                yield chunks.metadata_key(info), chunks.encode_metadata(info)
            for (index, data, _), todo in batch:
                for coord, chunk, n in unheld_chunks(index, data, info, todo):
                    sizes.append(n)
                    yield chunks.chunk_key(info, coord), chunks.encode_region(info, chunk)

        def write() -> None:
            write_keys(kv, encoded(), limit, one_commit=True)

        async with budget.hold(nbytes):  # host copies and encoded chunks
            await on_thread(None, write)
        written[0] += len(sizes)
        written[1] += sum(sizes) * itemsize

    await gather_first_error(
        [one(batch, n, write_metadata and k == 0) for k, (batch, n) in enumerate(batches)]
    )
    return written[0], written[1]
