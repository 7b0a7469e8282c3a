"""Changes a caller declares: the rows of a leaf that may differ from the base step.

An incremental save finds the changed chunks of a big leaf by hashing every chunk
(`ckptstore.checkpoint.chunklevel`): of a 256 MiB embedding table of which 2% changed, it
reads all 256 MiB. A training loop often knows better: its sparse optimizer touched some
rows (Check-N-Run, NSDI '22, tracks exactly these). With ``save(..., base=B,
changed={leaf: rows})`` only the chunks holding a declared row are read and hashed (and
written where they differ from B's); every other chunk of the leaf takes B's recorded
digest, is referenced and is never read.

The declaration is trusted, as a `SameObjects` vouching is: a row that changed but is not
declared keeps B's value in the new step, and nothing can tell afterwards (its recorded
digest is B's, of B's bytes). So it is relative to one committed attempt of B: given B as
the `SaveResult` of the save that made it, the save refuses a B committed again since
(`BaseStepGoneError`, as for the manager's base). Leaves not named are compared by their
digests as ever; a named leaf the base did not store in the same form, with chunk digests,
or whose pieces do not lie on chunk boundaries, is hashed whole (the declaration cannot
help there, and is not needed to be right).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptstore.datapath.arrays import sliced_shape
from ckptstore.datapath.regions import read_regions
from ckptstore.errors import ConfigError
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
from ckptstore.runtime.futures import gather_first_error, off_loop

#: Per item, per leaf: the sorted distinct rows (indices on its first axis) that may differ.
Declared = dict[str, dict[str, np.ndarray[Any, np.dtype[np.int64]]]]


def declared_rows(
    shapes: Mapping[str, Mapping[str, tuple[int, ...]]], changed: Any, base: int | None
) -> Declared:
    """``changed`` (per item, ``{leaf name: row indices}``) checked against the items'
    leaf ``shapes`` (per item, per leaf name), its rows as sorted distinct int64 arrays;
    `ConfigError` naming what is wrong (no ``base`` to be relative to, an unknown item or
    leaf, a 0-d leaf, rows that are not integers or lie outside the leaf's first axis)."""
    if base is None:
        raise ConfigError("changed= declares rows changed since a base step: give base= too")
    return checked_rows(shapes, changed)


def checked_rows(shapes: Mapping[str, Mapping[str, tuple[int, ...]]], changed: Any) -> Declared:
    """`declared_rows` of a declaration ``changed``, whatever its base."""
    if not isinstance(changed, Mapping):
        raise ConfigError(f"changed must map items to {{leaf: rows}}, not {type(changed).__name__}")
    out: Declared = {}
    for item, per_leaf in changed.items():
        if item not in shapes:
            raise ConfigError(f"changed names item {item!r}, which is not saved")
        if not isinstance(per_leaf, Mapping):
            raise ConfigError(f"changed[{item!r}] must map leaf names to rows")
        out[item] = {leaf: _rows(leaf, shapes[item], rows) for leaf, rows in per_leaf.items()}
    return out


def _rows(
    leaf: Any, shapes: Mapping[str, tuple[int, ...]], rows: Any
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """One leaf's declared rows, checked (see `declared_rows`)."""
    shape = shapes.get(leaf) if isinstance(leaf, str) else None
    if shape is None:
        some = ", ".join(sorted(shapes)[:8]) + (", ..." if len(shapes) > 8 else "")
        raise ConfigError(f"changed names leaf {leaf!r}, which the tree does not have ({some})")
    if not shape:
        raise ConfigError(f"changed names leaf {leaf!r}, a scalar: it has no rows")
    found = _as_rows(leaf, rows, shape[0])
    if found.size and (found[0] < 0 or found[-1] >= shape[0]):
        bad = found[0] if found[0] < 0 else found[-1]
        raise ConfigError(f"changed[{leaf!r}]: row {bad} is outside 0..{shape[0] - 1}")
    return found


def _as_rows(leaf: Any, rows: Any, count: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``rows`` as sorted distinct int64 row indices: a 1-d sequence or set of integers
    (empty: none), or a boolean mask of the ``count`` rows; `ConfigError` otherwise."""
    if isinstance(rows, (set, frozenset)):
        rows = sorted(rows)
    found = np.asarray(rows)
    if found.dtype == np.bool_ and found.ndim == 1:
        if found.shape[0] != count:
            raise ConfigError(
                f"changed[{leaf!r}]: a boolean mask needs one entry per row ({count}), "
                f"not {found.shape[0]}"
            )
        return np.flatnonzero(found).astype(np.int64)
    if found.size == 0:
        return np.zeros(0, np.int64)
    if found.ndim != 1 or found.dtype.kind not in "iu":
        raise ConfigError(
            f"changed[{leaf!r}] must be a 1-d sequence of integer row indices, a set of "
            f"them or a boolean mask of the rows, not {found.dtype} of shape {found.shape}"
        )
    return np.unique(found.astype(np.int64))


async def declared_table(
    pieces: Sequence[tuple[Index, Any, bool]],
    info: LeafInfo,
    recorded: str | None,
    rows: np.ndarray[Any, np.dtype[np.int64]],
    chunk_table: ChunkTable,
) -> PieceTable | None:
    """The piece digests of ``pieces`` (as `ckptstore.format.digests.piece_table` makes
    them) where only the chunks holding one of ``rows`` are hashed, the others taking the
    base's digests (``recorded``: its `encode_digests` string); their chunk digests go
    into ``chunk_table``. None (hash the leaf as ever) without the base's chunk digests or
    where a piece does not lie on chunk boundaries. The chunks to hash are split over the
    cores; the rest is vectorized (a table has thousands of chunks)."""
    if recorded is None or len(info.chunk_shape) == 0:
        return None
    shape, chunk_shape = info.shape, info.chunk_shape
    covered = [piece_linears(index, shape, chunk_shape) for index, _, _ in pieces]
    if any(linears is None for linears in covered):
        return None
    per_band = math.prod(chunk_grid(shape, chunk_shape)[1:])  # a band: one chunk tall
    bands = np.unique(rows // chunk_shape[0])
    jobs = []  # per piece: the chunks to hash (linear index, region in the piece)
    for (index, _, _), linears in zip(pieces, covered, strict=True):
        assert linears is not None
        todo = linears[np.isin(linears // per_band, bands)]
        jobs.append(
            list(zip(todo.tolist(), regions_in_piece(todo, index, shape, chunk_shape), strict=True))
        )

    def hash_some(which: Sequence[int]) -> dict[int, bytes]:
        found: dict[int, bytes] = {}
        for p in which:
            index, data, _ = pieces[p]
            groups = [list(g) for _, g in itertools.groupby(jobs[p], key=lambda job: job[1][0])]
            across = [slice(0, n) for n in sliced_shape(shape, index)[1:]]
            # On an accelerator only these bands are copied to the host, not the piece.
            bands = read_regions(data, [(group[0][1][0], *across) for group in groups])
            for rows, group in zip(bands, groups, strict=True):
                tall = slice(0, rows.shape[0])
                hashed = chunk_digests(rows, [(tall, *rel[1:]) for _, rel in group])
                found.update(zip((k for k, _ in group), hashed, strict=True))
        return found

    cores = os.cpu_count() or 2
    batches = [range(len(jobs))[i::cores] for i in range(cores)]
    itemsize = dtype_of(info.dtype).itemsize
    fresh: dict[int, bytes] = {}
    for found in await gather_first_error(
        [off_loop(functools.partial(hash_some, b), _nbytes(jobs, b, itemsize)) for b in batches]
    ):
        fresh.update(found)
    base = np.frombuffer(bytes.fromhex(recorded), np.uint8).reshape(-1, DIGEST_BYTES)
    hashed = np.fromiter(fresh, np.int64, len(fresh))
    digests = np.frombuffer(b"".join(fresh.values()), np.uint8).reshape(-1, DIGEST_BYTES)
    out: PieceTable = {}
    for (index, _, _), linears in zip(pieces, covered, strict=True):
        assert linears is not None
        mine = base[linears]  # a copy: the piece's chunk digests, the base's for now
        at = np.searchsorted(linears, hashed)  # a piece's linears ascend (C order)
        ours = (at < linears.size) & (linears[np.minimum(at, linears.size - 1)] == hashed)
        mine[at[ours]] = digests[ours]
        raw = mine.tobytes()
        hexed = raw.hex()
        step = 2 * DIGEST_BYTES
        chunk_table.update(
            (k, hexed[i * step : (i + 1) * step]) for i, k in enumerate(linears.tolist())
        )
        out[piece_key(index, shape)] = digest_of_chunks(raw)
    return out


def _nbytes(jobs: Sequence[Sequence[tuple[int, Index]]], which: Sequence[int], size: int) -> int:
    """The bytes the pieces ``which`` of `declared_table`'s jobs hash."""
    regions = (rel for p in which for _, rel in jobs[p])
    return size * sum(int(math.prod(r.stop - r.start for r in rel)) for rel in regions)
