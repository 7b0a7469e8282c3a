"""What a write does differently for chunk-level incremental saves: chunks it leaves out.

A leaf some of whose chunks the base step holds unchanged (`ckptstore.format.chunkrefs`)
is written chunk by chunk: of each piece this process owns, only the chunks not held
elsewhere. A piece with none held is written whole as ever, and one with all held not
at all. The chunk digests of what a write digests are kept in `ChunkPlan.digests`, beside
the piece digests, for the manifest.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.format.digests import ChunkTable, piece_chunks
from ckptstore.format.leaves import Index, LeafInfo


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
