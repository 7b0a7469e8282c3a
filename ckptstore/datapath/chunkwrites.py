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
from ckptstore.format import chunks
from ckptstore.format.digests import (
    ChunkTable,
    chunk_grid,
    piece_chunks,
    piece_linears,
    region_in_piece,
)
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.futures import gather_first_error, on_thread, write_keys


@dataclass
class ChunkPlan:
    """One process's chunk-level part of a write: per leaf, the chunks it must not write
    (``held``: linear chunk indices another attempt holds), and the chunk digests of its
    pieces (``digests``: filled by the write for the leaves it digests)."""

    held: dict[str, set[int]] = field(default_factory=dict)
    digests: dict[str, ChunkTable] = field(default_factory=dict)


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


def unheld_chunks(
    index: Index, data: Any, info: LeafInfo, held: Set[int]
) -> list[tuple[tuple[int, ...], np.ndarray[Any, Any], int]] | None:
    """The chunks of one piece not in ``held``: each one's grid coordinates, its data (an
    edge chunk padded with zeros to the chunk shape, as zarr3 stores it) and its own
    element count; None if the piece is not on chunk boundaries. Vectorized over the
    piece's chunks (thousands), regions made for the unheld ones only."""
    linears = piece_linears(index, info.shape, info.chunk_shape)
    if linears is None:
        return None
    todo = linears[~np.isin(linears, np.fromiter(held, np.int64, len(held)))]
    if not todo.size:
        return []
    host = data if isinstance(data, np.ndarray) else np.asarray(data)
    grid = chunk_grid(info.shape, info.chunk_shape)
    out = []
    for linear in todo.tolist():
        rel = region_in_piece(linear, index, info.shape, info.chunk_shape)
        part = host[rel]
        if part.shape != tuple(info.chunk_shape):  # an edge chunk
            padded = np.zeros(info.chunk_shape, dtype_of(info.dtype))
            padded[tuple(slice(0, n) for n in part.shape)] = part
            part = padded
        coord = tuple(int(k) for k in np.unravel_index(linear, grid))
        out.append((coord, part, math.prod(r.stop - r.start for r in rel)))
    return out


def on_chunks(pieces: Sequence[tuple[Index, Any, bool]], info: LeafInfo) -> bool:
    """Whether every piece lies on ``info``'s chunk boundaries (`unheld_chunks` takes it)."""
    shape, chunk_shape = info.shape, info.chunk_shape
    return all(piece_linears(index, shape, chunk_shape) is not None for index, _, _ in pieces)


def unheld_batches(
    pieces: Sequence[tuple[Index, Any, bool]], info: LeafInfo, held: Set[int], limit: int
) -> list[tuple[list[tuple[Index, Any, bool]], int]]:
    """``pieces`` (on the chunk grid) in batches of at most ``limit`` bytes of chunks not in
    ``held`` (a piece larger alone is a batch of its own), each with those bytes; pieces
    with none such are left out, and with no batch at all one empty batch remains (process
    0 still writes the leaf's zarr.json)."""
    taken = np.fromiter(held, np.int64, len(held))
    size = math.prod(info.chunk_shape) * dtype_of(info.dtype).itemsize
    out: list[tuple[list[tuple[Index, Any, bool]], int]] = []
    batch: list[tuple[Index, Any, bool]] = []
    total = 0
    for piece in pieces:
        linears = piece_linears(piece[0], info.shape, info.chunk_shape)
        assert linears is not None, "unheld_batches of a piece off the chunk grid"
        nbytes = int(np.count_nonzero(~np.isin(linears, taken))) * size
        if not nbytes:
            continue
        if batch and total + nbytes > limit:
            out.append((batch, total))
            batch, total = [], 0
        batch.append(piece)
        total += nbytes
    if batch or not out:
        out.append((batch, total))
    return out


async def write_in_part(
    kv: ts.KvStore,
    context: ts.Context,
    info: LeafInfo,
    pieces: Sequence[tuple[Index, Any, bool]],
    held: Set[int],
    budget: ByteBudget,
    write_metadata: bool,
) -> tuple[int, int]:
    """A leaf held in part, in a stored form this version writes itself (`chunks.known`;
    its pieces `on_chunks`): its zarr.json (``write_metadata``: process 0) and the chunks
    ``held`` does not name as raw OCDBT keys into ``kv``, no TensorStore open. Pieces go
    in batches of at most the budget's bytes, each batch one OCDBT commit
    (`unheld_batches`, `write_keys`). How many chunks it wrote, and their payload bytes."""
    itemsize = dtype_of(info.dtype).itemsize
    policy = policy_of(context)
    written = [0, 0]

    async def one(batch: Sequence[tuple[Index, Any, bool]], nbytes: int, meta: bool) -> None:
        limit = None if policy is None else policy.limit(nbytes)
        sizes: list[int] = []

        def encoded() -> Iterator[tuple[str, bytes]]:
            if meta:
                yield chunks.metadata_key(info), chunks.encode_metadata(info)
            for index, data, _ in batch:
                todo = unheld_chunks(index, data, info, held)
                assert todo is not None, "write_in_part of a piece off the chunk grid"
                for coord, chunk, n in todo:
                    sizes.append(n)
                    yield chunks.chunk_key(info, coord), chunks.encode_chunk(info, chunk)

        def write() -> None:
            write_keys(kv, encoded(), limit, one_commit=True)

        async with budget.hold(nbytes):  # host copies and encoded chunks
            await on_thread(None, write)
        written[0] += len(sizes)
        written[1] += sum(sizes) * itemsize

    batches = unheld_batches(pieces, info, held, budget.limit)
    await gather_first_error(
        [one(batch, n, write_metadata and k == 0) for k, (batch, n) in enumerate(batches)]
    )
    return written[0], written[1]
