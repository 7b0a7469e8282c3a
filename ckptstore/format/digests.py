"""Content digests of the pieces a process writes: what lets a later save reference them.

An incremental save (`ckptstore.checkpoint.save`, ``base=``) writes a leaf only if its
content differs from what the base step stored. "Equal" is decided by a 128-bit BLAKE3
digest of each piece's bytes (C order, little-endian: the bytes a zarr3 chunk holds
before its checksum), never by a 32-bit checksum: a digest decides identity, and a
collision would silently restore another array. BLAKE3 is a cryptographic hash that runs
faster than a disk writes (SIMD over its 1 KiB chunks) and releases the interpreter lock,
so the digests of a save cost a fraction of its write. A save records a digest per piece
(`PieceTable`: the piece's bounds -> its digest), and the manifest names the algorithm
(`ALGORITHM`), so any later save can use it as a base; a manager that does not save
incrementally records none (``save_items(digests=False)``), and its steps, as bases,
reference nothing. Tables of another algorithm (`LEGACY`: steps saved by earlier versions)
are never compared.

A piece of a leaf of more than one chunk is digested chunk by chunk (`piece_digests`):
each chunk of its zarr3 chunk grid gets its own digest (`ChunkTable`, what lets a later save
write only the chunks that changed: docs/incremental.md, "Chunk references"), and the
piece's digest is BLAKE3-128 of its chunks' digests (16 bytes each, in C order of their
grid coordinates), so the bytes are hashed once. A piece whose bounds do not lie on chunk
boundaries, and every piece of a leaf of one chunk, is digested whole.

A piece is what `ckptstore.datapath.arrays.owned_slices` gives a process: an addressable
shard with replica id 0, or a whole host value on process 0. The pieces of one leaf over
all processes cover the array exactly once, so two tables of one leaf are equal when one
process's pieces each appear, with the same digest, in the other: a partition that is a
subset of another partition of the same array is that partition.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import blake3
import numpy as np

from ckptstore.format.leaves import Index
from ckptstore.runtime.futures import off_loop

#: One leaf's record: each piece's bounds (`piece_key`) -> its digest (32 hex digits).
PieceTable = dict[str, str]

DIGEST_BYTES = 16
#: The algorithm of every digest this version records (a manifest item's ``digest``): BLAKE3-128,
#: a piece of a leaf of several chunks digested as its chunks' digests (`piece_digests`).
ALGORITHM = "blake3-128-chunks"
#: What versions before chunk digests recorded (every piece digested whole): never compared.
WHOLE_PIECES = "blake3-128"
#: What a manifest item with digests but no ``digest`` field holds (earlier versions).
LEGACY = "blake2b-128"
_HEX = re.compile(r"[0-9a-f]{32}")
_HEXES = re.compile(r"[0-9a-f]+")
_KEY = re.compile(r"(?:[0-9]+:[0-9]+(?:,[0-9]+:[0-9]+)*)?")


def piece_key(index: Index, shape: Sequence[int]) -> str:
    """A piece's bounds as text: ``start:stop`` per axis, comma-separated ("" for 0-d)."""
    out = []
    for s, dim in zip(index, shape, strict=True):
        start, stop = s.indices(dim)[:2]
        out.append(f"{start}:{stop}")
    return ",".join(out)


def parse_piece_key(key: str) -> Index:
    """The bounds `piece_key` wrote, as slices (``()`` for a 0-d leaf)."""
    if not key:
        return ()
    out = []
    for part in key.split(","):
        start, stop = part.split(":")
        out.append(slice(int(start), int(stop)))
    return tuple(out)


def digest(data: Any) -> str:
    """The 128-bit BLAKE3 digest (hex) of an array's bytes in C order, little-endian
    (`ALGORITHM`). Runs without the interpreter lock."""
    arr = np.asarray(data)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return str(blake3.blake3(flat.data).hexdigest(length=DIGEST_BYTES))


async def digest_off_loop(data: Any, nbytes: int) -> str:
    """`digest`, on a worker thread for all but small arrays."""
    return await off_loop(lambda: digest(data), nbytes)


async def piece_table(
    pieces: Sequence[tuple[Index, Any, bool]],
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    itemsize: int,
    chunk_table: ChunkTable | None = None,
) -> PieceTable:
    """The digests of one leaf's ``pieces`` (as `owned_slices` gives them); their chunks'
    digests go into ``chunk_table`` where `piece_digests` makes them. Up to one piece per
    core is hashed at a time (each on a worker thread, a device's piece copied to the host
    first), every one finished before an error is raised."""
    slots = asyncio.Semaphore(os.cpu_count() or 2)

    async def one(index: Index, data: Any) -> tuple[str, ChunkTable]:
        async with slots:
            nbytes = piece_size(index, shape) * itemsize
            return await off_loop(lambda: piece_digests(data, index, shape, chunk_shape), nbytes)

    found = await asyncio.gather(
        *(one(index, data) for index, data, _ in pieces), return_exceptions=True
    )
    out: PieceTable = {}
    for (index, _, _), got in zip(pieces, found, strict=True):
        if isinstance(got, BaseException):
            raise got
        out[piece_key(index, shape)] = got[0]
        if chunk_table is not None:
            chunk_table.update(got[1])
    return out


#: One leaf's chunk digests: linear chunk index (C order over the chunk grid) -> digest.
ChunkTable = dict[int, str]


def chunk_grid(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Chunks per axis of a leaf's regular chunk grid (``()`` for a 0-d leaf)."""
    return tuple(-(-n // c) if n else 0 for n, c in zip(shape, chunk_shape, strict=True))


def chunk_count(shape: Sequence[int], chunk_shape: Sequence[int]) -> int:
    """How many chunks the leaf's grid has (1 for a 0-d leaf)."""
    return math.prod(chunk_grid(shape, chunk_shape))


def chunk_region(linear: int, shape: Sequence[int], chunk_shape: Sequence[int]) -> Index:
    """The region of the leaf that chunk ``linear`` (C order over the grid) covers;
    ValueError if the grid has no such chunk."""
    coord = _grid_coord(linear, chunk_grid(shape, chunk_shape))
    return tuple(
        slice(k * c, min((k + 1) * c, n)) for k, c, n in zip(coord, chunk_shape, shape, strict=True)
    )


def regions_in_piece(
    linears: np.ndarray[Any, np.dtype[np.int64]],
    index: Index,
    shape: Sequence[int],
    chunk_shape: Sequence[int],
) -> list[Index]:
    """The region of each chunk of ``linears`` relative to the piece ``index`` that holds
    it, the arithmetic vectorized (a save of declared rows asks for hundreds); ValueError
    for a chunk outside the grid."""
    grid = chunk_grid(shape, chunk_shape)
    if linears.size and (linears.min() < 0 or linears.max() >= math.prod(grid)):
        bad = int(linears.min() if linears.min() < 0 else linears.max())
        raise ValueError(f"chunk {bad} is outside a chunk grid of {tuple(grid)}")
    if not grid:
        return [() for _ in range(linears.size)]
    bounds = []
    for k, c, n, s in zip(np.unravel_index(linears, grid), chunk_shape, shape, index, strict=True):
        start = s.indices(n)[0]
        bounds.append(((k * c - start).tolist(), (np.minimum((k + 1) * c, n) - start).tolist()))
    return [tuple(slice(a[i], b[i]) for a, b in bounds) for i in range(linears.size)]


def chunks_size(linears: Iterable[int], shape: Sequence[int], chunk_shape: Sequence[int]) -> int:
    """The number of elements in the chunks ``linears`` names (each once, as given);
    ValueError if the grid has no such chunk. Vectorized: a table has thousands."""
    grid = chunk_grid(shape, chunk_shape)
    found = np.fromiter(linears, dtype=np.int64)
    if found.size and (found.min() < 0 or found.max() >= math.prod(grid)):
        bad = int(found.min() if found.min() < 0 else found.max())
        raise ValueError(f"chunk {bad} is outside a chunk grid of {tuple(grid)}")
    if not grid or not found.size:  # a 0-d leaf's one chunk holds one element
        return int(found.size)
    sizes = np.ones(found.size, np.int64)
    for k, c, n in zip(np.unravel_index(found, grid), chunk_shape, shape, strict=True):
        sizes *= np.minimum((k + 1) * c, n) - k * c
    return int(sizes.sum())


def _grid_coord(linear: int, grid: Sequence[int]) -> list[int]:
    """Chunk ``linear``'s coordinates in ``grid`` (C order); ValueError outside it."""
    if not 0 <= linear < math.prod(grid):
        raise ValueError(f"chunk {linear} is outside a chunk grid of {tuple(grid)}")
    coord = []
    for n in reversed(grid):
        linear, k = divmod(linear, n)
        coord.append(k)
    coord.reverse()
    return coord


def piece_chunks(
    index: Index, shape: Sequence[int], chunk_shape: Sequence[int]
) -> list[tuple[int, Index]] | None:
    """The chunks the piece ``index`` covers, in C order: each one's linear index and its
    region relative to the piece. None if the piece's bounds are not on chunk boundaries
    (then it holds parts of chunks)."""
    spans = _chunk_spans(index, shape, chunk_shape)
    if spans is None:
        return None
    grid = chunk_grid(shape, chunk_shape)
    axes = []  # per axis: (the chunk's linear offset on that axis, its region in the piece)
    stride = 1
    for (start, ks), n, c, g in reversed(list(zip(spans, shape, chunk_shape, grid, strict=True))):
        axes.append([(k * stride, slice(k * c - start, min((k + 1) * c, n) - start)) for k in ks])
        stride *= g
    axes.reverse()
    return [
        (sum(offset for offset, _ in combo), tuple(rel for _, rel in combo))
        for combo in itertools.product(*axes)
    ]


def piece_linears(
    index: Index, shape: Sequence[int], chunk_shape: Sequence[int]
) -> np.ndarray[Any, np.dtype[np.int64]] | None:
    """The linear indices of the chunks the piece ``index`` covers, in C order (as
    `piece_chunks` lists them), vectorized; None where `piece_chunks` is None."""
    spans = _chunk_spans(index, shape, chunk_shape)
    if spans is None:
        return None
    if not spans:  # a 0-d leaf: its one chunk
        return np.zeros(1, np.int64)
    mesh = np.ix_(*(np.arange(ks.start, ks.stop) for _, ks in spans))
    grid = chunk_grid(shape, chunk_shape)
    return np.ravel_multi_index(mesh, grid).reshape(-1).astype(np.int64)


def _chunk_spans(
    index: Index, shape: Sequence[int], chunk_shape: Sequence[int]
) -> list[tuple[int, range]] | None:
    """Per axis, the piece's start and the range of chunk coordinates it covers; None if
    its bounds are not on chunk boundaries."""
    out = []
    for s, n, c in zip(index, shape, chunk_shape, strict=True):
        start, stop = s.indices(n)[:2]
        if start % c or (stop % c and stop != n) or stop <= start:
            return None
        out.append((start, range(start // c, -(-stop // c))))
    return out


def piece_digests(
    data: Any, index: Index, shape: Sequence[int], chunk_shape: Sequence[int]
) -> tuple[str, ChunkTable]:
    """The digest of one piece (`ALGORITHM`) and, for a leaf of several chunks whose piece
    lies on chunk boundaries, the digest of each chunk it covers. Then the piece's digest
    is BLAKE3-128 of those (16 bytes each, in order), so its bytes are hashed once; else
    it is `digest` of the piece. Synchronous: call it off the event loop."""
    if chunk_count(shape, chunk_shape) <= 1:
        return digest(data), {}
    covered = piece_chunks(index, shape, chunk_shape)
    if covered is None:
        return digest(data), {}
    hashes = chunk_digests(np.asarray(data), [rel for _, rel in covered])
    table = {linear: hashed.hex() for (linear, _), hashed in zip(covered, hashes, strict=True)}
    return digest_of_chunks(b"".join(hashes)), table


def digest_of_chunks(joined: bytes) -> str:
    """A piece's digest (`ALGORITHM`) from its chunks' digests, 16 bytes each, joined in C
    order of their grid coordinates: BLAKE3-128 of them."""
    return str(blake3.blake3(joined).hexdigest(length=DIGEST_BYTES))


def chunk_digests(arr: np.ndarray[Any, Any], regions: Sequence[Index]) -> list[bytes]:
    """`digest` of each of ``arr``'s ``regions``, as bytes: a region that is not one run of
    memory is copied into one buffer, reused from region to region, and hashed there (a
    fresh copy per region cost as much as the hashing)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    parts = [arr[rel] for rel in regions]
    largest = max((part.nbytes for part in parts), default=0)
    buffer = np.empty(largest, np.uint8)
    out = []
    for part in parts:
        if part.flags.c_contiguous:
            flat = part.reshape(-1).view(np.uint8)
        else:
            flat = buffer[: part.nbytes]
            np.copyto(flat.view(part.dtype).reshape(part.shape), part)
        out.append(blake3.blake3(flat.data).digest(length=DIGEST_BYTES))
    return out


def matches(mine: Mapping[str, str], base: Mapping[str, str] | None) -> bool:
    """Whether every piece of ``mine`` is in ``base`` with the same digest (see the module
    docstring: over all processes, that makes the two tables equal)."""
    if base is None:
        return False
    return all(base.get(key) == value for key, value in mine.items())


def check_table(leaf: str, table: Any) -> PieceTable:
    """A manifest's record of one leaf's digests, checked; raises ValueError."""
    if not isinstance(table, dict) or not table:
        raise ValueError(f"leaf {leaf!r}: bad digests")
    for key, value in table.items():
        if not (isinstance(key, str) and _KEY.fullmatch(key)):
            raise ValueError(f"leaf {leaf!r}: bad piece bounds {str(key)[:40]!r}")
        if not (isinstance(value, str) and _HEX.fullmatch(value)):
            raise ValueError(f"leaf {leaf!r}: bad digest {str(value)[:40]!r}")
    return dict(table)


def is_digest(value: Any) -> bool:
    """Whether ``value`` is a digest as this module writes them (32 lowercase hex digits)."""
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def are_digests(values: Collection[Any]) -> bool:
    """Whether every one of ``values`` `is_digest`: one match over them all (a chunk
    table has thousands)."""
    if not all(isinstance(v, str) and len(v) == 2 * DIGEST_BYTES for v in values):
        return False
    return not values or _HEXES.fullmatch("".join(values)) is not None


def piece_size(index: Index, shape: Sequence[int]) -> int:
    """The number of elements in the piece ``index`` of an array of ``shape``."""
    n = 1
    for s, dim in zip(index, shape, strict=True):
        n *= len(range(*s.indices(dim)))
    return n


class StreamedPiece:
    """A piece's digest (as `piece_digests` makes it) from slabs of its first axis, read
    one after another, so that a reader never holds more than a slab: `verify` reads every
    piece of a leaf of gigabytes this way.

    A slab is a run of rows of the piece; in C order it is the next bytes of the piece, so
    a piece digested whole is hashed as one stream, and a piece digested by its chunks
    (its bounds on chunk boundaries) is cut on chunk rows, its chunks coming slab after
    slab in the C order of their grid coordinates."""

    def __init__(
        self,
        index: Index,
        shape: Sequence[int],
        chunk_shape: Sequence[int],
        itemsize: int,
        max_bytes: int,
    ) -> None:
        self.shape, self.chunk_shape = tuple(shape), tuple(chunk_shape)
        self._by_chunks = (
            chunk_count(shape, chunk_shape) > 1
            and piece_chunks(index, shape, chunk_shape) is not None
        )
        self._whole = blake3.blake3()
        self._chunks: list[bytes] = []
        self._added = 0
        #: The slabs to read, in order: regions of the leaf (not of the piece).
        self.slabs: list[Index] = [index]
        if index:
            start, stop = index[0].indices(shape[0])[:2]
            row = max(1, itemsize * piece_size(index[1:], shape[1:]))
            rows = max(1, max_bytes // row)
            if self._by_chunks:  # whole chunk rows (the piece starts on one)
                rows = -(-rows // chunk_shape[0]) * chunk_shape[0]
            self.slabs = [
                (slice(a, min(a + rows, stop)), *index[1:]) for a in range(start, stop, rows)
            ] or [index]

    def add(self, data: Any) -> None:
        """Hash the next slab's values (synchronous: call it off the event loop)."""
        slab, self._added = self.slabs[self._added], self._added + 1
        arr = np.asarray(data)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if self._by_chunks:
            covered = piece_chunks(slab, self.shape, self.chunk_shape)
            assert covered is not None  # cut on chunk rows of a piece on chunk boundaries
            self._chunks += chunk_digests(arr, [rel for _, rel in covered])
        else:
            self._whole.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)

    def hexdigest(self) -> str:
        """The piece's digest, once every slab was added."""
        if self._added != len(self.slabs):
            raise ValueError(f"{len(self.slabs) - self._added} slabs of the piece not added")
        if self._by_chunks:
            return digest_of_chunks(b"".join(self._chunks))
        return str(self._whole.hexdigest(length=DIGEST_BYTES))
