"""What each leaf of a committed step takes in storage, measured from the store.

A compressed leaf's size is known only once written, and TensorStore writes big leaves'
chunks without telling how large they came out; so `stored_sizes` measures them: the
lengths the item's merged OCDBT index records for each chunk key (`ocdbt_index.load`),
and, for a packed leaf, its entry's chunk as the manifest records it (a compressed one's
size is in its pack reference). Sizes are of the chunks (data and crc32c), not of the
``zarr.json`` documents or the index. `ckptstore info` shows them beside each codec.
"""

from __future__ import annotations

from collections import defaultdict

import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.backends.tsdeadline import within
from ckptstore.checkpoint.merge import owner
from ckptstore.datapath import ocdbt_index
from ckptstore.format.manifest import Manifest
from ckptstore.format.packs import chunk_size


async def stored_sizes(backend: Backend, manifest: Manifest) -> dict[str, dict[str, int | None]]:
    """Per item, per leaf: bytes of its stored chunks on ``backend`` (None where the store's
    index is not one this version reads: then it is not measured)."""
    out: dict[str, dict[str, int | None]] = {}
    for name, item in manifest.items.items():
        sizes: dict[str, int | None] = {}
        by_dir: dict[str, set[str]] = defaultdict(set)  # a referenced leaf: its holder's
        for leaf, info in item.leaves.items():
            ref = item.packed.get(leaf)
            if ref is not None:
                sizes[leaf] = chunk_size(info, ref)
            else:
                by_dir[manifest.leaf_dir(name, leaf)].add(leaf)
        for prefix, leaves in by_dir.items():
            sizes.update(await _measured(backend, prefix, leaves))
        out[name] = {leaf: sizes[leaf] for leaf in item.leaves}
    return out


async def _measured(backend: Backend, prefix: str, leaves: set[str]) -> dict[str, int | None]:
    """The chunk bytes of ``leaves`` in the merged store at ``prefix``."""
    ctx = backend.ts_context
    opening = ts.KvStore.open(backend.kvstore_spec(prefix), context=ctx)
    index = await ocdbt_index.load(await within(opening, ctx, 0, f"opening {prefix!r}"))
    if index is None:
        return dict.fromkeys(leaves)
    sizes: dict[str, int | None] = dict.fromkeys(leaves, 0)
    for key, value in index.items():
        leaf, rest = owner(key, leaves)
        if leaf is not None and rest != "zarr.json":
            length = value.length if isinstance(value, ocdbt_index.Location) else len(value)
            sizes[leaf] = (sizes[leaf] or 0) + length
    return sizes
