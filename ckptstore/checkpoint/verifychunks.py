"""Verifying a leaf held in part by other attempts (chunk references).

Such a leaf (`ckptstore.format.chunkrefs`) is read as a restore reads it: chunk by chunk,
each from its holder's store (`ckptstore.datapath.chunkreads.RoutedChunks`), every
chunk's crc32c checked. A chunk another attempt holds is also compared with the digest
the save recorded for it (`ItemManifest.chunk_digests`): a reference can be pointed
anywhere by a forged manifest, and only the digest says the bytes are the ones saved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ckptstore.datapath.chunkreads import RoutedChunks
from ckptstore.datapath.rawleaf import RawLeaf
from ckptstore.datapath.reads import Chunks
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format.chunkrefs import chunk_digest
from ckptstore.format.digests import (
    chunk_count,
    chunk_region,
    digest_off_loop,
    piece_size,
)
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.format.manifest import ItemManifest
from ckptstore.runtime.bytebudget import ByteBudget


def written_regions(item: ItemManifest, info: LeafInfo) -> Sequence[Index]:
    """The regions of the chunks of ``info``'s leaf its own attempt holds."""
    held = {k for k, _ in item.chunk_refs[info.name].chunks()}
    n = chunk_count(info.shape, info.chunk_shape)
    return [chunk_region(k, info.shape, info.chunk_shape) for k in range(n) if k not in held]


async def verify_in_part(
    item: ItemManifest,
    info: LeafInfo,
    own: Chunks,
    holders: Mapping[int, Chunks],
    budget: ByteBudget,
    checked: Callable[[int], None],
) -> int:
    """Read every chunk of the leaf from its store (checksums checked) and compare each
    chunk, its own or one another attempt holds, with its recorded digest;
    `CorruptCheckpointError` on the first that differs or is missing. Returns the payload
    bytes read."""
    refs = item.chunk_refs[info.name]
    recorded = item.chunk_digests.get(info.name)
    if recorded is None:
        raise CorruptCheckpointError("chunks held elsewhere but no chunk digests", leaf=info.name)
    raw = await RawLeaf.open(RoutedChunks(info, own, holders, refs), info)
    if raw is None:
        raise CorruptCheckpointError("zarr.json is not what a save writes", leaf=info.name)
    itemsize = dtype_of(info.dtype).itemsize
    total = 0
    for k in range(chunk_count(info.shape, info.chunk_shape)):
        region = chunk_region(k, info.shape, info.chunk_shape)
        nbytes = piece_size(region, info.shape) * itemsize
        async with budget.hold(nbytes):
            data = await raw.read(region)
            if await digest_off_loop(data, nbytes) != chunk_digest(recorded, k):
                which = "it references" if refs.holder(k) is not None else "of its own"
                raise CorruptCheckpointError(
                    f"chunk {k} {which} is not the one its save recorded (its digest differs)",
                    leaf=info.name,
                )
        checked(nbytes)
        total += nbytes
    return total
