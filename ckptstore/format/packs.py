"""Packs: many small leaves in one object, written at the disk's speed.

Thousands of small leaves written through TensorStore's OCDBT writer cost several
copies of every byte (ours into one Python ``bytes`` per chunk, TensorStore's into
its own buffer, the kernel's into the page cache) and two keys each; that path wrote a
tree of thousands of small leaves at about half the speed of ``dd oflag=direct``
(`docs/benchmarks.md`). A pack holds the stored chunks of many
small single-chunk leaves (`ckptstore.format.chunks.small`), one after another: each
leaf's ``zarr.json`` (the document TensorStore would store for it) and then its
chunk in the very bytes a zarr3 chunk has (data, compressed where the leaf has a codec,
then its crc32c). It is written
with one gathered write (`Backend.write_gather`: straight from the leaves' own
buffers, through ``O_DIRECT`` on local disks) and each leaf is found by its
`PackRef`. Consecutive leaves of a pack are read back with one ranged read. The
stored ``zarr.json`` must be byte for byte what the manifest's record of the leaf
gives, so a manifest edited to another shape or dtype (and re-signed) is caught
before its data is read, as it is for leaves in OCDBT stores.

This module is what a pack is (`PackRef`, `pack_parts`, `entry_size`); writing and reading
packs is the data path's (`ckptstore.datapath.packs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.backends.base import Buffer
from ckptstore.backends.keys import validate_key
from ckptstore.errors import CkptStoreError
from ckptstore.format import chunks
from ckptstore.format.leaves import LeafInfo


@dataclass(frozen=True)
class PackRef:
    """Where a packed leaf's entry (its ``zarr.json``, then its chunk) starts: in object
    ``key`` (relative to the item's directory) at byte ``offset``. Its length follows from
    the leaf's schema (`entry_size`), except for a compressed leaf (one with a codec):
    ``size`` is then its stored chunk's length (compressed data and checksum), and its
    ``zarr.json`` in the pack names the codec."""

    key: str
    offset: int
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        if self.size is None:  # raw leaves' records stay as they were
            return {"key": self.key, "offset": self.offset}
        return {"key": self.key, "offset": self.offset, "size": self.size}

    @classmethod
    def from_json(cls, leaf: str, data: Any) -> PackRef:
        """A reference as a manifest records it, checked; raises ValueError naming the
        leaf (the manifest's parser reports it as corruption)."""
        key = data.get("key") if isinstance(data, dict) else None
        offset = data.get("offset") if isinstance(data, dict) else None
        size = data.get("size") if isinstance(data, dict) else None
        if not isinstance(key, str) or type(offset) is not int or offset < 0:
            raise ValueError(f"leaf {leaf!r}: malformed pack reference {str(data)[:80]}")
        if size is not None and not (type(size) is int and size > 4):
            raise ValueError(f"leaf {leaf!r}: bad packed size {str(size)[:40]}")
        try:
            _valid_key(key)  # below the item's directory: relative, never up and out
        except CkptStoreError as exc:
            raise ValueError(f"leaf {leaf!r}: bad pack key: {exc}") from exc
        return cls(key, offset, size)

    def check(self, info: LeafInfo) -> None:
        """ValueError unless this reference fits ``info``: a size exactly where the leaf is
        compressed, and no larger than a chunk of it may be (`chunks.stored_size`)."""
        if (self.size is None) != (info.codec is None):
            said = "no size" if self.size is None else f"size {self.size}"
            raise ValueError(f"packed leaf {info.name!r} has {said} with codec {info.codec}")
        if self.size is not None and self.size > chunks.stored_size(info):
            raise ValueError(f"packed leaf {info.name!r}: size {self.size} is too large")


#: A writer's record of its packed leaves, beside its packs: ``{leaf: PackRef.to_json()}``.
#: The save's primary process copies it into the manifest (coordination messages stay small).
INDEX = "packs.json"


def pack_parts(leaves: Sequence[tuple[LeafInfo, Any]]) -> tuple[list[Buffer], list[int]]:
    """The buffers of a pack holding ``leaves`` (info and host array each), one after
    another (three per leaf: its ``zarr.json``, its data, its checksum), and each leaf's
    offset; a raw leaf's data is not copied if it is little-endian and C-contiguous
    already. Computes every checksum (and compresses where a leaf has a codec): call it
    off the event loop."""
    parts: list[Buffer] = []
    offsets: list[int] = []
    at = 0
    for info, data in leaves:
        meta = chunks.encode_metadata(info)
        raw, crc = chunks.chunk_parts(info, np.asarray(data))
        parts += [meta, raw, crc]
        offsets.append(at)
        at += len(meta) + raw.nbytes + len(crc)
    return parts, offsets


def pack_refs(
    key: str,
    leaves: Sequence[tuple[LeafInfo, Any]],
    parts: Sequence[Buffer],
    offsets: Sequence[int],
) -> list[PackRef]:
    """Each leaf's `PackRef` in pack ``key``, from `pack_parts`' result: a compressed leaf's
    records its stored chunk's size (its data part and checksum)."""
    refs = []
    for i, ((info, _), offset) in enumerate(zip(leaves, offsets, strict=True)):
        size = None
        if info.codec is not None:
            size = memoryview(parts[3 * i + 1]).nbytes + memoryview(parts[3 * i + 2]).nbytes
        refs.append(PackRef(key, offset, size))
    return refs


def entry_size(info: LeafInfo, ref: PackRef | None = None) -> int:
    """Bytes of one leaf in a pack: its ``zarr.json`` and its stored chunk (a compressed
    leaf's as ``ref`` records it)."""
    return len(chunks.encode_metadata(info)) + chunk_size(info, ref)


def chunk_size(info: LeafInfo, ref: PackRef | None = None) -> int:
    """Bytes of a packed leaf's stored chunk (compressed: as its reference records)."""
    return ref.size if ref is not None and ref.size is not None else chunks.stored_size(info)


#: `validate_key`, remembered: a manifest names the same few packs thousands of times
#: (a bad key is not remembered: it raises every time).
_valid_key = functools.lru_cache(maxsize=1024)(validate_key)
