"""Packs: many small leaves in one object, written at the disk's speed.

Thousands of small leaves written through TensorStore's OCDBT writer cost several
copies of every byte (ours into one Python ``bytes`` per chunk, TensorStore's into
its own buffer, the kernel's into the page cache) and two keys each; on this
project's test machine that path wrote a 5,000-leaf tree at ~0.45x the speed of
``dd oflag=direct`` (`docs/benchmarks.md`). A pack holds the stored chunks of many
small single-chunk leaves (`ckptstore.chunks.small`), one after another, in the
very bytes a zarr3 chunk has (data, then its crc32c); it is written with one
gathered write (`Backend.write_gather`: straight from the leaves' own buffers,
through ``O_DIRECT`` on local disks) and each leaf is found by its `PackRef`.
Consecutive leaves of a pack are read back with one ranged read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore import chunks
from ckptstore.backends._errors import gather_first_error
from ckptstore.backends.base import Backend, Buffer
from ckptstore.backends.keys import validate_key
from ckptstore.errors import CkptStoreError, CorruptCheckpointError
from ckptstore.leaves import LeafInfo


@dataclass(frozen=True)
class PackRef:
    """Where a packed leaf's stored chunk starts: in object ``key`` (relative to the
    item's directory) at byte ``offset``. Its length follows from the leaf's schema."""

    key: str
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "offset": self.offset}

    @classmethod
    def from_json(cls, leaf: str, data: Any) -> PackRef:
        """A reference read from a manifest; anything malformed is corruption."""
        key = data.get("key") if isinstance(data, dict) else None
        offset = data.get("offset") if isinstance(data, dict) else None
        if not isinstance(key, str) or type(offset) is not int or offset < 0:
            raise CorruptCheckpointError(f"malformed pack reference {data!r}", leaf=leaf)
        try:
            validate_key(key)
        except CkptStoreError as exc:
            raise CorruptCheckpointError(f"pack key {key!r}: {exc}", leaf=leaf) from exc
        return cls(key, offset)


def pack_parts(leaves: Sequence[tuple[LeafInfo, Any]]) -> tuple[list[Buffer], list[int]]:
    """The buffers of a pack holding ``leaves`` (info and host array each), one after
    another, and each leaf's offset; a leaf's data is not copied if it is little-endian
    and C-contiguous already. Computes every checksum: call it off the event loop."""
    parts: list[Buffer] = []
    offsets: list[int] = []
    at = 0
    for info, data in leaves:
        raw, crc = chunks.chunk_parts(info, np.asarray(data))
        parts += [raw, crc]
        offsets.append(at)
        at += raw.nbytes + len(crc)
    return parts, offsets


async def write_pack(
    backend: Backend, key: str, leaves: Sequence[tuple[LeafInfo, Any]]
) -> list[PackRef]:
    """Write one pack of ``leaves`` at ``key`` (below the item's directory) on ``backend``;
    returns each leaf's `PackRef`, in order."""
    parts, offsets = await asyncio.to_thread(pack_parts, leaves)
    await backend.write_gather(key, parts)
    return [PackRef(key, offset) for offset in offsets]


async def read_packed(
    backend: Backend, prefix: str, leaves: Sequence[tuple[LeafInfo, PackRef]]
) -> list[np.ndarray[Any, Any]]:
    """Each leaf's array, from packs below ``prefix`` (the item's directory). Leaves that
    follow one another in a pack are read with one ranged read, each into an aligned
    buffer of its own; a checksum, size or reference that does not match is corruption."""
    out: list[np.ndarray[Any, Any] | None] = [None] * len(leaves)

    async def run(indices: list[int]) -> None:
        first = leaves[indices[0]][1]
        bufs = [chunks.aligned_empty((chunks.stored_size(leaves[i][0]),), _BYTE) for i in indices]
        views = [buf.data for buf in bufs]
        key = f"{prefix}/{first.key}" if prefix else first.key
        try:
            await backend.read_into(key, first.offset, views)
        except CorruptCheckpointError as exc:  # the pack ends before these leaves do
            names = ", ".join(leaves[i][0].name for i in indices)
            raise CorruptCheckpointError(f"pack {first.key} too short for {names}: {exc}") from exc

        def decode() -> None:
            for i, buf in zip(indices, bufs, strict=True):
                out[i] = chunks.decode_chunk(leaves[i][0], buf, copy=False)

        await asyncio.to_thread(decode)

    await gather_first_error(run(indices) for indices in _runs(leaves))
    assert all(arr is not None for arr in out)
    return out  # type: ignore[return-value]


_BYTE = np.dtype(np.uint8)


def _runs(leaves: Sequence[tuple[LeafInfo, PackRef]]) -> list[list[int]]:
    """Indices of ``leaves`` grouped into runs that lie one after another in one pack."""
    order = sorted(range(len(leaves)), key=lambda i: (leaves[i][1].key, leaves[i][1].offset))
    runs: list[list[int]] = []
    end: tuple[str, int] | None = None
    for i in order:
        info, ref = leaves[i]
        if end != (ref.key, ref.offset) or len(runs[-1]) >= _MAX_RUN:
            runs.append([])
        runs[-1].append(i)
        end = (ref.key, ref.offset + chunks.stored_size(info))
    return runs


#: Leaves read by one ranged read at most (one system call takes 1,024 buffers).
_MAX_RUN = 256
