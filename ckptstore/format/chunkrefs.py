"""Chunk references: the chunks of a leaf that other attempts hold (chunk-level incremental saves).

An incremental save (``base=``) of a leaf of several chunks whose shape, dtype and chunk
shape equal the base's writes only the chunks whose digests changed
(`ckptstore.format.digests.piece_digests`); the manifest records, per such leaf, which of
its chunks each holder attempt has (`ChunkRefs`: an index into `Manifest.references` ->
ranges of linear chunk indices, C order over the chunk grid). Every other chunk, and the
leaf's ``zarr.json``, is in the step's own attempt. The manifest also records every chunk's
digest of such leaves (`encode_digests`: one hex string per leaf), which is what the next
save compares with. Ranges keep the record small: a table of thousands of chunks with a
few changed ones is a few ranges, not a list of thousands of numbers.

Both records are parsed as data and checked (`ChunkRefs.from_json`, `decode_digests`):
ranges sorted, disjoint, inside the grid, holders that exist; anything else is a
ValueError, which the manifest reports as `CorruptCheckpointError`.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.format.digests import ChunkTable

_HEXES = re.compile(r"[0-9a-f]+")
_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")
HEX = 32


@dataclass(frozen=True)
class ChunkRefs:
    """One leaf's chunks held by other attempts: reference index -> sorted, disjoint
    ``[start, stop)`` ranges of linear chunk indices."""

    held: Mapping[int, tuple[tuple[int, int], ...]]

    @classmethod
    def of(cls, holders: Mapping[int, int]) -> ChunkRefs:
        """From ``{linear chunk index: reference index}``."""
        linears = np.fromiter(holders.keys(), np.int64, len(holders))
        return cls.of_arrays(linears, np.fromiter(holders.values(), np.int64, len(holders)))

    @classmethod
    def of_arrays(
        cls,
        linears: np.ndarray[Any, np.dtype[np.int64]],
        holders: np.ndarray[Any, np.dtype[np.int64]],
    ) -> ChunkRefs:
        """From distinct linear chunk indices and each one's reference index, vectorized
        (a table's record names thousands of chunks)."""
        order = np.argsort(linears, kind="stable")
        linears, holders = linears[order], holders[order]
        out: dict[int, tuple[tuple[int, int], ...]] = {}
        for k in np.unique(holders).tolist():
            mine = linears[holders == k]
            cuts = np.flatnonzero(np.diff(mine) != 1) + 1  # where a run of chunks breaks
            starts = mine[np.concatenate(([0], cuts))]
            stops = mine[np.concatenate((cuts - 1, [mine.size - 1]))] + 1
            out[k] = tuple(zip(starts.tolist(), stops.tolist(), strict=True))
        return cls(out)

    def chunks(self) -> Iterator[tuple[int, int]]:
        """Every held chunk as (linear index, reference index)."""
        for k, ranges in self.held.items():
            for start, stop in ranges:
                for linear in range(start, stop):
                    yield linear, k

    def owners(
        self, linears: np.ndarray[Any, np.dtype[np.int64]]
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The reference index holding each chunk of ``linears``, -1 where none does (the
        step's own attempt): `holder` vectorized, over every range at once."""
        spans = [(a, b, k) for k, ranges in self.held.items() for a, b in ranges]
        if not spans or not linears.size:
            return np.full(linears.size, -1, np.int64)
        starts, stops, refs = (np.array(column, np.int64) for column in zip(*spans, strict=True))
        size = max(int(stops.max()), int(linears.max()) + 1)
        steps = np.zeros(size + 1, np.int64)  # the ranges are disjoint: one step up, one down
        np.add.at(steps, starts, refs + 1)
        np.add.at(steps, stops, -(refs + 1))
        owners: np.ndarray[Any, np.dtype[np.int64]] = np.cumsum(steps)[linears] - 1
        return owners

    def holder(self, linear: int) -> int | None:
        """The reference index holding chunk ``linear``; None: the step's own attempt."""
        for k, ranges in self.held.items():
            at = bisect.bisect_right(ranges, (linear, float("inf"))) - 1
            if at >= 0 and ranges[at][0] <= linear < ranges[at][1]:
                return k
        return None

    @property
    def count(self) -> int:
        return sum(stop - start for ranges in self.held.values() for start, stop in ranges)

    def to_json(self) -> dict[str, Any]:
        return {str(k): [[a, b] for a, b in ranges] for k, ranges in self.held.items()}

    @classmethod
    def from_json(cls, leaf: str, doc: Any, references: int, chunks: int) -> ChunkRefs:
        """A manifest's record, checked against the number of references and of the
        leaf's chunks; ValueError naming the leaf otherwise."""
        if not isinstance(doc, dict) or not doc:
            raise ValueError(f"leaf {leaf!r}: chunk references are not a non-empty object")
        held: dict[int, tuple[tuple[int, int], ...]] = {}
        spans: list[tuple[int, int]] = []
        for key, ranges in doc.items():
            if not (isinstance(key, str) and _INDEX.fullmatch(key) and int(key) < references):
                raise ValueError(f"leaf {leaf!r}: bad chunk holder {str(key)[:20]!r}")
            if not isinstance(ranges, list) or not ranges or len(ranges) > chunks:
                raise ValueError(f"leaf {leaf!r}: bad chunk ranges of holder {key}")
            checked = []
            for pair in ranges:
                if not (
                    isinstance(pair, list)
                    and len(pair) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                    and 0 <= pair[0] < pair[1] <= chunks
                ):
                    raise ValueError(f"leaf {leaf!r}: bad chunk range {str(pair)[:40]}")
                checked.append((pair[0], pair[1]))
            if checked != sorted(checked):
                raise ValueError(f"leaf {leaf!r}: chunk ranges of holder {key} are not sorted")
            held[int(key)] = tuple(checked)
            spans += checked
        spans.sort()
        for (_, stop), (start, _) in itertools.pairwise(spans):
            if start < stop:
                raise ValueError(f"leaf {leaf!r}: chunk ranges overlap")
        return cls(held)


def encode_digests(table: ChunkTable, chunks: int) -> str | None:
    """A leaf's chunk digests as one hex string (`HEX` digits per chunk, in linear order);
    None unless ``table`` has every one of its ``chunks``."""
    if len(table) != chunks:
        return None
    try:
        return "".join(table[k] for k in range(chunks))
    except KeyError:
        return None


def decode_digests(leaf: str, text: Any, chunks: int) -> str:
    """A manifest's chunk digests of one leaf, checked; ValueError otherwise."""
    if not (isinstance(text, str) and len(text) == HEX * chunks and _HEXES.fullmatch(text)):
        raise ValueError(f"leaf {leaf!r}: bad chunk digests")
    return text


def chunk_digest(text: str, linear: int) -> str:
    """Chunk ``linear``'s digest in a leaf's `encode_digests` string."""
    return text[HEX * linear : HEX * (linear + 1)]
