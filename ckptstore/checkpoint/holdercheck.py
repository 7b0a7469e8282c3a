"""Before a restore reads bytes another attempt holds, that attempt's own manifest agrees.

An incremental step reads some leaves (or some chunks of a leaf) from the attempts its
manifest names under ``references``. A manifest edited and its marker re-signed could
point those reads anywhere: at another attempt holding a leaf of the same shape, at
chunks the holder never wrote, or keep the reference and change the digest that says
what the bytes were. `verify` finds each by hashing the bytes; a restore does not hash
them (that would cost a large share of its time), but it makes the cheap checks, one
small read per holder: the holder's own manifest must hold the leaf (or the chunk)
itself, not by a reference of its own, and record the same digests for it, and the same
pack. A holder whose manifest is not there (a durable tier holding only the objects it
was given: `ckptstore.tiers.holders`) is not checked. docs/reliability.md says which.
"""

from __future__ import annotations

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.storeditem import settle
from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.format.chunkrefs import chunk_digest
from ckptstore.format.digests import ALGORITHM
from ckptstore.format.manifest import ItemManifest, Manifest, Reference


async def check_holders(backend: Backend, manifest: Manifest, item: str) -> None:
    """`CorruptCheckpointError` where item ``item`` of ``manifest`` reads a leaf or chunk
    from a holder whose own manifest does not hold it, or records other digests for it."""
    saved = manifest.items[item]
    if saved.digest_algorithm != ALGORITHM or not (saved.refs or saved.chunk_refs):
        return
    used = sorted({*saved.refs.values(), *(k for c in saved.chunk_refs.values() for k in c.held)})
    found = await settle(_holder_item(backend, manifest.references[k], item) for k in used)
    holders = dict(zip(used, found, strict=True))
    for leaf, k in saved.refs.items():
        holder = holders[k]
        if holder is not None:
            _same_leaf(saved, holder, leaf, manifest.references[k])
    for leaf, refs in saved.chunk_refs.items():
        for linear, k in refs.chunks():
            holder = holders[k]
            if holder is not None:
                _same_chunk(saved, holder, leaf, linear, manifest.references[k])


async def _holder_item(backend: Backend, ref: Reference, item: str) -> ItemManifest | None:
    """Item ``item`` of the attempt ``ref`` names, as its own manifest records it (None
    where that manifest is not there)."""
    where = f"{backend.url}/{ref.dir.manifest}"
    try:
        data = await backend.read(ref.dir.manifest)
    except NotFoundError:
        return None
    holder = Manifest.from_bytes(data, where=where)
    if (holder.step, holder.attempt) != (ref.step, ref.attempt) or item not in holder.items:
        raise CorruptCheckpointError(
            f"step {ref.step} attempt {ref.attempt}, referenced for item {item!r}, has a "
            f"manifest {where} of another attempt or without that item"
        )
    return holder.items[item]


def _same_leaf(saved: ItemManifest, holder: ItemManifest, leaf: str, ref: Reference) -> None:
    why = None
    if leaf in holder.refs or leaf in holder.chunk_refs:
        why = "holds it by a reference of its own (a reference names the bytes' writer)"
    elif leaf not in holder.leaves or holder.digest_algorithm != ALGORITHM:
        why = "does not hold it with digests"
    elif holder.digests.get(leaf) != saved.digests.get(leaf):
        why = "recorded other digests for it"
    elif holder.packed.get(leaf) != saved.packed.get(leaf):
        why = "packed it elsewhere"
    if why is not None:
        raise CorruptCheckpointError(
            f"the step reads it from step {ref.step} attempt {ref.attempt}, which {why}",
            leaf=leaf,
        )


def _same_chunk(
    saved: ItemManifest, holder: ItemManifest, leaf: str, linear: int, ref: Reference
) -> None:
    why = None
    refs = holder.chunk_refs.get(leaf)
    if leaf in holder.refs or (refs is not None and refs.holder(linear) is not None):
        why = "holds it by a reference of its own (a reference names the bytes' writer)"
    elif leaf not in holder.chunk_digests or leaf not in saved.chunk_digests:
        why = "recorded no digest for it"
    elif chunk_digest(holder.chunk_digests[leaf], linear) != chunk_digest(
        saved.chunk_digests[leaf], linear
    ):
        why = "recorded another digest for it"
    if why is not None:
        raise CorruptCheckpointError(
            f"the step reads chunk {linear} from step {ref.step} attempt {ref.attempt}, "
            f"which {why}",
            leaf=leaf,
        )
