"""Content digests of the pieces a process writes: what lets a later save reference them.

An incremental save (`ckptstore.checkpoint.save`, ``base=``) writes a leaf only if its
content differs from what the base step stored. "Equal" is decided by a 128-bit BLAKE3
digest of each piece's bytes (C order, little-endian: the bytes a zarr3 chunk holds
before its checksum), never by a 32-bit checksum: a digest decides identity, and a
collision would silently restore another array. BLAKE3 is a cryptographic hash that runs
at several GB/s per core (SIMD over its 1 KiB chunks) and releases the interpreter lock,
so the digests of a save cost a fraction of its write. A save records a digest per piece
(`PieceTable`: the piece's bounds -> its digest), and the manifest names the algorithm
(`ALGORITHM`), so any later save can use it as a base; a manager that does not save
incrementally records none (``save_items(digests=False)``), and its steps, as bases,
reference nothing. Tables of another algorithm (`LEGACY`: steps saved by earlier versions)
are never compared.

A piece is what `ckptstore.datapath.arrays.owned_slices` gives a process: an addressable
shard with replica id 0, or a whole host value on process 0. The pieces of one leaf over
all processes cover the array exactly once, so two tables of one leaf are equal when one
process's pieces each appear, with the same digest, in the other: a partition that is a
subset of another partition of the same array is that partition.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import blake3
import numpy as np

from ckptstore.format.leaves import Index
from ckptstore.runtime.futures import off_loop

#: One leaf's record: each piece's bounds (`piece_key`) -> its digest (32 hex digits).
PieceTable = dict[str, str]

DIGEST_BYTES = 16
#: The algorithm of every digest this version records (a manifest item's ``digest``).
ALGORITHM = "blake3-128"
#: What a manifest item with digests but no ``digest`` field holds (earlier versions).
LEGACY = "blake2b-128"
_HEX = re.compile(r"[0-9a-f]{32}")
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
    pieces: Sequence[tuple[Index, Any, bool]], shape: Sequence[int], itemsize: int
) -> PieceTable:
    """The digests of one leaf's ``pieces`` (as `owned_slices` gives them)."""
    out: PieceTable = {}
    for index, data, _ in pieces:
        nbytes = piece_size(index, shape) * itemsize
        out[piece_key(index, shape)] = await digest_off_loop(data, nbytes)
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


def piece_size(index: Index, shape: Sequence[int]) -> int:
    """The number of elements in the piece ``index`` of an array of ``shape``."""
    n = 1
    for s, dim in zip(index, shape, strict=True):
        n *= len(range(*s.indices(dim)))
    return n
