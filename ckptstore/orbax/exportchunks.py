"""Exporting a leaf held in part by other attempts (chunk references) to Orbax.

An Orbax leaf is one zarr3 array, its chunks in one store; a leaf an incremental save
wrote in part (`ckptstore.format.chunkrefs`) has its chunks in several attempts' stores,
so no mirrored store holds it whole. Such a leaf is read as a restore reads it (each chunk
from its holder, checksum checked) and written into the export's view chunk by chunk, in
the very keys TensorStore writes (`ckptstore.format.chunks`), a batch of chunks at a time;
packed leaves are written into the view the same way (`ckptstore.orbax.exporter`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.restore import manifest_item
from ckptstore.datapath.stores import ocdbt_spec
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import chunks
from ckptstore.format.digests import chunk_count, chunk_grid, chunk_region
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import Manifest
from ckptstore.orbax.metadata import OrbaxEntry

#: Bytes of chunks read and written into the view at a time.
BATCH_BYTES = 64 << 20


async def write_in_part(
    src: Backend,
    manifest: Manifest,
    item: str,
    dst: Backend,
    item_dir: str,
    found: list[OrbaxEntry],
) -> int:
    """Write every leaf of ``item`` held in part into the view at ``dst/item_dir`` under its
    Orbax name; returns their bytes."""
    saved = manifest.items[item]
    todo = [(e, saved.leaves[e.leaf]) for e in found if e.leaf in saved.chunk_refs]
    if not todo:
        return 0
    stored = await manifest_item(src, manifest, item)
    assert stored.open_raw is not None  # a native step's item reads chunk by chunk
    view = await ts.KvStore.open(ocdbt_spec(dst.kvstore_spec(item_dir)), context=dst.ts_context)
    for e, info in todo:
        (read,) = await stored.open_raw([info])
        if read is None:
            raise CorruptCheckpointError("cannot be read chunk by chunk", leaf=info.name)
        renamed = dataclasses.replace(info, name=e.param)
        await view.write(chunks.metadata_key(renamed), chunks.encode_metadata(renamed))
        n = chunk_count(info.shape, info.chunk_shape)
        per_batch = max(1, BATCH_BYTES // chunks.stored_size(info))
        for start in range(0, n, per_batch):
            batch = range(start, min(n, start + per_batch))
            values = await asyncio.gather(*(_chunk(read, info, k) for k in batch))
            grid = chunk_grid(info.shape, info.chunk_shape)
            await asyncio.gather(
                *(
                    view.write(chunks.chunk_key(renamed, _coord(k, grid)), value)
                    for k, value in zip(batch, values, strict=True)
                )
            )
    return sum(info.nbytes for _, info in todo)


async def _chunk(read: Any, info: LeafInfo, k: int) -> bytes:
    """Chunk ``k`` of the leaf as stored: an edge chunk padded to the chunk shape with the
    fill value (zero), as zarr3 stores it."""
    region = chunk_region(k, info.shape, info.chunk_shape)
    data = np.asarray(await read(region))
    assert data.shape == tuple(s.stop - s.start for s in region)
    return chunks.encode_region(info, data)


def _coord(k: int, grid: tuple[int, ...]) -> list[int]:
    """Chunk ``k``'s grid coordinates (C order)."""
    return [int(x) for x in np.unravel_index(k, grid)]
