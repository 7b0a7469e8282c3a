"""Declared rows of a leaf, hashed and written in one pass (`ckptstore.checkpoint.declared`).

A save with ``changed={leaf: rows}`` names the only rows of a leaf that may differ from its
base. Of each piece this process owns, only the chunks holding a declared row are
candidates; every other chunk takes the digest the base recorded for it and is left out
(the base's holder has it), never read. The candidates are read a band of rows at a time
(on an accelerator only those bands are gathered and copied: `datapath.regions`), hashed,
and each whose digest differs from the base's is encoded and handed to the OCDBT store at
once, so that its write runs while the next bands are hashed (hashing first and writing
after took the two one after the other: ~8 and ~10 ms for 160 candidates and 40 changed
chunks of 128 KiB). The write ends once every chunk handed over is durable.

What is recorded is what a save hashing every chunk records: the piece digests, every
chunk's digest (`folded`), and the chunks left out. Which process writes what needs no
round: chunks divide pieces, so each chunk has one owner (docs/incremental.md).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ckptstore.backends.tsdeadline import policy_of
from ckptstore.datapath.regions import read_regions
from ckptstore.format import chunks
from ckptstore.format.digests import (
    DIGEST_BYTES,
    ChunkTable,
    PieceTable,
    chunk_digests,
    chunk_grid,
    digest_of_chunks,
    piece_key,
    piece_linears,
    regions_in_piece,
)
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.runtime.futures import gather_first_error, on_thread, wait_all, wait_here


@dataclass(frozen=True)
class DeclaredLeaf:
    """A leaf whose changes since the base are declared: only ``rows`` (sorted distinct
    indices on its first axis) may differ. ``recorded``: the base's chunk digests, one row
    of `DIGEST_BYTES` per chunk, in C order over the chunk grid."""

    rows: np.ndarray[Any, np.dtype[np.int64]]
    recorded: np.ndarray[Any, np.dtype[np.uint8]]

    @classmethod
    def of(
        cls,
        pieces: Sequence[tuple[Index, Any, bool]],
        info: LeafInfo,
        recorded: str | None,
        rows: np.ndarray[Any, np.dtype[np.int64]],
    ) -> DeclaredLeaf | None:
        """The declaration for ``pieces`` of ``info``'s leaf, given the base's chunk digests
        (``recorded``: their `encode_digests` string); None where it cannot help (then the
        leaf is hashed whole, as ever): no chunk digests recorded, a 0-d leaf, a stored form
        this version does not write itself (`chunks.known`), or a piece off the chunk grid."""
        if recorded is None or not info.chunk_shape or not chunks.known(info):
            return None
        if any(piece_linears(i, info.shape, info.chunk_shape) is None for i, _, _ in pieces):
            return None
        table = np.frombuffer(bytes.fromhex(recorded), np.uint8).reshape(-1, DIGEST_BYTES)
        return cls(rows, table)

    def candidates(self, index: Index, info: LeafInfo) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The linear indices of the chunks of the piece ``index`` that hold a declared row
        (a band of chunks one chunk tall holds a row in every chunk of it)."""
        linears = piece_linears(index, info.shape, info.chunk_shape)
        assert linears is not None  # checked by `of`
        per_band = math.prod(chunk_grid(info.shape, info.chunk_shape)[1:])
        bands = np.unique(self.rows // info.chunk_shape[0])
        return linears[np.isin(linears // per_band, bands)]


def folded(
    pieces: Sequence[tuple[Index, Any, bool]],
    info: LeafInfo,
    recorded: np.ndarray[Any, np.dtype[np.uint8]],
    fresh: Mapping[int, bytes],
    chunk_table: ChunkTable,
) -> PieceTable:
    """The piece digests of ``pieces`` (as `digests.piece_table` makes them) where the
    chunks in ``fresh`` have those digests and every other chunk the base's (``recorded``,
    see `DeclaredLeaf`); each chunk's digest, in hex, goes into ``chunk_table``. Vectorized:
    a table has thousands of chunks."""
    hashed = np.fromiter(fresh, np.int64, len(fresh))
    digests = np.frombuffer(b"".join(fresh.values()), np.uint8).reshape(-1, DIGEST_BYTES)
    step = 2 * DIGEST_BYTES
    out: PieceTable = {}
    for index, _, _ in pieces:
        linears = piece_linears(index, info.shape, info.chunk_shape)
        assert linears is not None
        mine = recorded[linears]  # a copy: the piece's chunk digests, the base's for now
        at = np.searchsorted(linears, hashed)  # a piece's linears ascend (C order)
        ours = (at < linears.size) & (linears[np.minimum(at, linears.size - 1)] == hashed)
        mine[at[ours]] = digests[ours]
        raw = mine.tobytes()
        hexed = raw.hex()
        chunk_table.update(
            (k, hexed[i * step : (i + 1) * step]) for i, k in enumerate(linears.tolist())
        )
        out[piece_key(index, info.shape)] = digest_of_chunks(raw)
    return out


@dataclass(frozen=True)
class DeclaredWrite:
    """What `write_declared` did: the piece digests of this process's pieces, the chunks of
    them it left out (held elsewhere), and how many it wrote, with their payload bytes."""

    table: PieceTable
    held: set[int]
    written: int
    nbytes: int


#: One band of candidates: the piece's number, and each chunk's linear index and region
#: in the piece (the regions of one band start at the same row).
_Band = tuple[int, list[tuple[int, Index]]]


async def write_declared(
    kv: ts.KvStore,
    context: ts.Context,
    info: LeafInfo,
    pieces: Sequence[tuple[Index, Any, bool]],
    declared: DeclaredLeaf,
    chunk_table: ChunkTable,
    *,
    max_inflight_bytes: int,
    write_metadata: bool,
) -> DeclaredWrite:
    """This process's pieces of a declared leaf into ``kv``: the leaf's ``zarr.json``
    (``write_metadata``: process 0), then each candidate chunk that differs from the base,
    written while the others are hashed (module docstring), the bands split over the
    cores. Every chunk's digest goes into ``chunk_table``. At most ``max_inflight_bytes``
    of encoded chunks wait for their write at a time. Ends when every write is durable."""
    shape, chunk_shape = info.shape, info.chunk_shape
    bands: list[_Band] = []
    for p, (index, _, _) in enumerate(pieces):
        todo = declared.candidates(index, info)
        jobs = zip(todo.tolist(), regions_in_piece(todo, index, shape, chunk_shape), strict=True)
        bands += [(p, list(g)) for _, g in itertools.groupby(jobs, key=lambda job: job[1][0])]
    policy = policy_of(context)
    meta = []
    if write_metadata:
        encoded = chunks.encode_metadata(info)
        meta.append(kv.write(chunks.metadata_key(info), encoded))
    cores = os.cpu_count() or 2
    shares = [bands[k::cores] for k in range(cores) if bands[k::cores]]
    size = math.prod(chunk_shape) * dtype_of(info.dtype).itemsize
    try:
        found = await gather_first_error(
            [
                on_thread(
                    None,
                    functools.partial(
                        _hash_and_write,
                        kv,
                        info,
                        pieces,
                        declared.recorded,
                        share,
                        max_inflight_bytes // len(shares),
                        None if policy is None else policy.limit(size * sum(len(b) for b in share)),
                    ),
                )
                for share in shares
            ]
        )
    except BaseException:
        with contextlib.suppress(Exception):  # no write of this leaf runs on past the error
            await wait_all(meta)
        raise
    await wait_all(meta, None if policy is None else policy.limit(len(meta)))
    fresh: dict[int, bytes] = {}
    changed: set[int] = set()
    nbytes = 0
    for digests, wrote, wrote_bytes in found:
        fresh.update(digests)
        changed.update(wrote)
        nbytes += wrote_bytes
    table = folded(pieces, info, declared.recorded, fresh, chunk_table)
    held = {int(k) for k in chunk_table} - changed
    return DeclaredWrite(table, held, len(changed), nbytes)


def _hash_and_write(
    kv: ts.KvStore,
    info: LeafInfo,
    pieces: Sequence[tuple[Index, Any, bool]],
    recorded: np.ndarray[Any, np.dtype[np.uint8]],
    share: Sequence[_Band],
    max_inflight_bytes: int,
    limit: float | None,
) -> tuple[dict[int, bytes], list[int], int]:
    """One worker's bands (in piece order): each read, its chunks hashed, the changed ones
    written; their digests, the chunks written and their payload bytes, once every write is
    durable. A failure waits for the writes already issued before it is raised."""
    grid = chunk_grid(info.shape, info.chunk_shape)
    fresh: dict[int, bytes] = {}
    wrote: list[int] = []
    issued: list[ts.Future[Any]] = []
    waited, inflight, nbytes = 0, 0, 0
    try:
        for p, of_piece in itertools.groupby(share, key=lambda band: band[0]):
            index, data, _ = pieces[p]
            groups = [group for _, group in of_piece]
            tall = zip(index[1:], info.shape[1:], strict=True)
            across = [slice(0, len(range(*s.indices(n)))) for s, n in tall]
            for rows, group in zip(
                read_regions(data, [(group[0][1][0], *across) for group in groups]),
                groups,
                strict=True,
            ):
                regions = [(slice(0, rows.shape[0]), *rel[1:]) for _, rel in group]
                for (k, _), region, found in zip(
                    group, regions, chunk_digests(rows, regions), strict=True
                ):
                    fresh[k] = found
                    if found == recorded[k].tobytes():
                        continue
                    part = rows[region]  # an edge chunk's is smaller: encoding pads it
                    value = chunks.encode_region(info, part)
                    coord = [int(c) for c in np.unravel_index(k, grid)]
                    issued.append(kv.write(chunks.chunk_key(info, coord), value))
                    wrote.append(k)
                    nbytes += part.nbytes
                    inflight += len(value)
                    if inflight > max_inflight_bytes:  # let the store catch up
                        wait_here(issued[waited:], limit)
                        waited, inflight = len(issued), 0
        wait_here(issued[waited:], limit)
    except BaseException:
        with contextlib.suppress(Exception):
            wait_here(issued[waited:])
        raise
    return fresh, wrote, nbytes
