"""Reading a stored leaf's regions chunk by chunk, outside TensorStore.

A leaf whose ``zarr.json`` is byte for byte what a save writes has chunks this
module decodes itself (`ckptstore.format.chunks`: checksums at hardware speed). A region
is assembled from the chunks it overlaps; a region that is exactly one chunk is
that chunk's buffer, not a copy. Regions announced together (`RawLeaf.expect`:
the slices of a leaf restored onto another mesh) read a chunk they share once.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.datapath.reads import Chunks, get_values
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import chunks
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.runtime.futures import off_loop
from ckptstore.runtime.hostpool import aligned_empty


class RawLeaf:
    """A stored leaf read chunk by chunk from ``source``, checksums checked by
    `ckptstore.format.chunks` (several times faster than TensorStore's own check)."""

    def __init__(self, source: Chunks, info: LeafInfo):
        self.source, self.info = source, info
        self._shared: dict[str, _Shared] = {}  # chunks several announced regions overlap

    @classmethod
    async def open(cls, source: Chunks, info: LeafInfo) -> RawLeaf | None:
        """The leaf, if its ``zarr.json`` is byte for byte what a save writes; else None
        (then TensorStore's reader, `open_leaf`, must judge it)."""
        if not chunks.known(info):
            return None
        (meta,) = await get_values(source, [chunks.metadata_key(info)], info.name)
        return cls(source, info) if meta is not None and chunks.as_written(info, meta) else None

    @classmethod
    async def open_many(cls, source: Chunks, infos: Sequence[LeafInfo]) -> list[RawLeaf | None]:
        """`open` for many leaves, their ``zarr.json`` values fetched in one batch: a few
        reads of nearby values instead of a round trip per leaf, each of which would
        otherwise queue behind large reads."""
        known = [info for info in infos if chunks.known(info)]
        try:
            metas = await source.get([chunks.metadata_key(info) for info in known])
        except Exception:  # each on its own: its error names the leaf at fault
            return [await cls.open(source, info) for info in infos]
        written = {
            info.name
            for info, meta in zip(known, metas, strict=True)
            if meta is not None and chunks.as_written(info, meta)
        }
        return [cls(source, info) if info.name in written else None for info in infos]

    async def read(self, index: Index) -> np.ndarray[Any, Any]:
        """The region ``index`` (step-1 slices) of the leaf; read-only when it is exactly
        one stored chunk (no copy at all), else assembled from the chunks it overlaps."""
        info = self.info
        region = _Region(index, info)
        mine = [key for key in region.keys if key not in self._shared]
        shared_keys = [key for key in region.keys if key in self._shared]
        try:
            found = await get_values(self.source, mine, info.name) if mine else []
            shared = dict(zip(shared_keys, await self._fetch_shared(shared_keys), strict=True))

            def assemble() -> np.ndarray[Any, Any]:
                return region.assemble({**shared, **self._decode(mine, found)})

            nbytes = math.prod(region.shape) * dtype_of(info.dtype).itemsize
            return await off_loop(assemble, nbytes)
        finally:  # this region has taken its part (or failed): shared chunks may go
            self._release(shared_keys)

    __call__ = read  # a `ckptstore.checkpoint.storeditem.Read`

    def expect(self, indices: Sequence[Index]) -> None:
        """Announce the regions about to be read (one `read` each): a chunk that more
        than one of them overlaps (slices of a leaf restored onto another mesh) is then
        read and checked once, and kept until the last of them has taken its part."""
        regions = [_Region(index, self.info) for index in indices]
        uses = collections.Counter(key for region in regions for key in region.keys)
        for key, n in uses.items():
            if n > 1:
                self._shared[key] = _Shared(n)

    async def _fetch_shared(self, keys: Sequence[str]) -> list[np.ndarray[Any, Any]]:
        for key in keys:
            entry = self._shared[key]
            if entry.piece is None:  # the first region to need it reads it for all
                entry.piece = asyncio.ensure_future(self._fetch_one(key))
        # Shielded: one reader's cancellation must not cancel a read the others wait for.
        # All awaited, each outcome taken: no failed read is left unretrieved.
        pieces = [self._shared[key].piece for key in keys]
        got = await asyncio.gather(*map(asyncio.shield, pieces), return_exceptions=True)  # type: ignore[arg-type]
        for outcome in got:
            if isinstance(outcome, BaseException):
                raise outcome
        return got  # type: ignore[return-value]

    async def _fetch_one(self, key: str) -> np.ndarray[Any, Any]:
        found = await get_values(self.source, [key], self.info.name)
        size = sum(len(got) for got in found if got is not None)
        return await off_loop(lambda: self._decode([key], found)[key], size)

    def _decode(self, keys: Sequence[str], found: Sequence[Any]) -> dict[str, np.ndarray[Any, Any]]:
        pieces = {}
        for key, got in zip(keys, found, strict=True):
            if got is None:
                raise CorruptCheckpointError(f"chunk {key} is missing", leaf=self.info.name)
            pieces[key] = chunks.decode_chunk(self.info, got, copy=False, key=key)
        return pieces

    def _release(self, keys: Sequence[str]) -> None:
        for key in keys:
            entry = self._shared[key]
            entry.uses -= 1
            if entry.uses == 0:  # the last region took its part: the chunk can go
                del self._shared[key]


@dataclass
class _Shared:
    """A chunk several regions overlap: the read of it, once started, and how many of
    those regions have yet to take their part."""

    uses: int
    piece: asyncio.Future[np.ndarray[Any, Any]] | None = None


class _Region:
    """One region of a leaf: its bounds, and the chunks it overlaps (their coordinates
    and keys)."""

    def __init__(self, index: Index, info: LeafInfo):
        self.info = info
        bounds = [s.indices(d)[:2] for s, d in zip(index, info.shape, strict=False)]
        self.bounds = bounds + [(0, d) for d in info.shape[len(bounds) :]]
        self.shape = tuple(b - a for a, b in self.bounds)
        ranges = (
            range(a // c, -(-b // c))
            for (a, b), c in zip(self.bounds, info.chunk_shape, strict=True)
        )
        empty = math.prod(self.shape) == 0
        self.coords = [] if empty else list(itertools.product(*ranges))
        self.keys = [chunks.chunk_key(info, coord) for coord in self.coords]

    def assemble(self, pieces: dict[str, np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
        """The region laid out from its chunks' decoded ``pieces`` (by key); a region that
        is exactly one chunk is that chunk, not a copy."""
        info, sizes = self.info, self.info.chunk_shape
        if not self.coords:
            return np.empty(self.shape, dtype_of(info.dtype))
        starts = [a for a, _ in self.bounds]
        if (
            len(self.coords) == 1
            and self.shape == sizes
            and all(a == c * n for a, c, n in zip(starts, self.coords[0], sizes, strict=True))
        ):
            return pieces[self.keys[0]]
        out = aligned_empty(self.shape, dtype_of(info.dtype))  # devices adopt it as is
        for coord, key in zip(self.coords, self.keys, strict=True):
            dst, src = [], []
            for (a, b), c, n in zip(self.bounds, coord, sizes, strict=True):
                first, last = max(a, c * n), min(b, (c + 1) * n)
                dst.append(slice(first - a, last - a))
                src.append(slice(first - c * n, last - c * n))
            out[tuple(dst)] = pieces[key][tuple(src)]
        return out
