"""Reading a leaf whose chunks lie in several attempts' stores (chunk references).

A leaf an incremental save wrote in part (`ckptstore.format.chunkrefs`) has its
``zarr.json`` and written chunks in the step's own store and its other chunks in the
stores of the attempts the manifest names for them. `RoutedChunks` is one `Chunks`
source over all of them: each chunk key goes to the store its holder has, so a
`ckptstore.datapath.rawleaf.RawLeaf` reads and checks the leaf as it reads any other.
A chunk its holder lacks is missing (`CorruptCheckpointError`), never a fill value.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ckptstore.datapath.reads import Buffer, Chunks
from ckptstore.format.chunkrefs import ChunkRefs
from ckptstore.format.digests import chunk_grid
from ckptstore.format.leaves import LeafInfo


class RoutedChunks:
    """The chunks of one leaf from ``own`` (the step's store) and ``holders`` (reference
    index -> that attempt's store), as ``refs`` assigns them."""

    def __init__(
        self, info: LeafInfo, own: Chunks, holders: Mapping[int, Chunks], refs: ChunkRefs
    ) -> None:
        self.info, self.own, self.holders, self.refs = info, own, holders, refs
        self.prefix = f"{info.name}/c/"
        self.grid = chunk_grid(info.shape, info.chunk_shape)

    def source_of(self, key: str) -> Chunks:
        """The store holding ``key`` (a chunk key of the leaf, or its ``zarr.json``: the
        step's own, or where the step holds no chunk of the leaf, the holder of chunk 0,
        which wrote the same document)."""
        if not key.startswith(self.prefix):
            if self.refs.count < math.prod(self.grid):
                return self.own
            first = self.refs.holder(0)
            return self.own if first is None else self.holders[first]
        coord = tuple(int(x) for x in key[len(self.prefix) :].split("/"))
        k = self.refs.holder(int(np.ravel_multi_index(coord, self.grid)))
        return self.own if k is None else self.holders[k]

    async def get(self, keys: Sequence[str]) -> Sequence[Buffer | None]:
        groups: dict[int, tuple[Chunks, list[int]]] = {}
        for at, key in enumerate(keys):
            source = self.source_of(key)
            groups.setdefault(id(source), (source, []))[1].append(at)
        found = await asyncio.gather(
            *(source.get([keys[at] for at in ats]) for source, ats in groups.values()),
            return_exceptions=True,  # every read ends before the first error is raised
        )
        for outcome in found:
            if isinstance(outcome, BaseException):
                raise outcome
        out: list[Buffer | None] = [None] * len(keys)
        for (_, ats), values in zip(groups.values(), found, strict=True):
            assert not isinstance(values, BaseException)
            for at, value in zip(ats, values, strict=True):
                out[at] = value
        return out
