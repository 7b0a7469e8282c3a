"""Orbax out: a committed ckptstore step as a checkpoint Orbax 0.12 restores.

Why an export rather than files written beside the step: Orbax reads a tree from
one OCDBT store whose keys are its dot-joined names, and an OCDBT store can only
reference data files below its own directory (measured: a copy from a sibling
store raises ``NotImplementedError: CopyRange not supported``). A
`CheckpointManager` step keeps its tree in ``<step>/default/``, a sibling of
ckptstore's attempt, so no view inside a ckptstore root can serve it; and a view
there would outlive `delete_step` and be collected by `gc`. So the export writes a
new directory and never touches the source:

```
DST/                                   (or DST/<step>/default/ with manager=True; a step
                                       of several items or with JSON items: one
                                       directory per item, as an Orbax Composite step)
  ckptstore.<item>/                    the step's stores, hard-linked (local disk,
                                       same filesystem) or copied object by object
  ckptstore.<item>.held-<k>/           an incremental step's: the stores of each
                                       attempt holding leaves it references, the same way
  manifest.ocdbt, d/                   an OCDBT store keyed by Orbax's names: B-tree
                                       references to the data above, no data
  _METADATA, _CHECKPOINT_METADATA      what Orbax needs to rebuild the tree
  commit_success.txt                   last
DST/<item>/metadata                    a JSON item, as Orbax's ``JsonSave`` writes it
DST/<step>/metrics/metrics             with manager=True: the step's metrics, as Orbax's
                                       CheckpointManager writes them
```

`ckptstore.orbax.exportitems` chooses the items and refuses the names Orbax reserves.

`ckptstore.orbax.destination` says how the directory is finished (renamed into place on
local disk). Copies are bounded by a byte budget; hard links share the source's immutable
data files and add no bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.backends.local import LocalBackend
from ckptstore.checkpoint.storeditem import settle
from ckptstore.checkpoint.target import Target
from ckptstore.datapath.packs import read_packed
from ckptstore.datapath.stores import ocdbt_spec
from ckptstore.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.format import chunks, layout
from ckptstore.format.layout import (
    ORBAX_CHECKPOINT_METADATA,
    ORBAX_COMMIT_SUCCESS,
    ORBAX_TREE_METADATA,
)
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import ItemManifest, Manifest
from ckptstore.orbax.destination import Destination
from ckptstore.orbax.exportchunks import write_in_part
from ckptstore.orbax.exportitems import METRICS_ITEM, choose_items
from ckptstore.orbax.inspect import read_all
from ckptstore.orbax.items import JSON_FILE
from ckptstore.orbax.keys import ARRAY_METADATAS
from ckptstore.orbax.metadata import (
    DEFAULT_ITEM,
    HANDLER,
    JSON_HANDLER,
    OrbaxEntry,
    array_metadatas,
    checkpoint_metadata,
    entries,
    tree_metadata,
)
from ckptstore.protocol import latest_manifest
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.progress import Progress

#: Bytes of copied objects held in memory at once (one larger object may pass alone).
COPY_BUDGET = 256 << 20


@dataclass(frozen=True)
class ExportResult:
    step: int
    path: str  # the Orbax directory to restore (the step directory with manager=True)
    leaves: int
    bytes: int  # the leaves' bytes
    linked: int  # objects hard-linked (no bytes written)
    copied: int  # objects copied
    copied_bytes: int  # theirs, and the packed leaves' written into the view
    #: The Orbax items written, for a Composite export (a step of several items, or of
    #: JSON items); empty where the export is one tree.
    items: tuple[str, ...] = ()
    #: The step's metrics were written as Orbax's ``metrics`` item (``manager=True``), where
    #: Orbax's ``metrics(step)`` and ``best_step()`` read them.
    metrics: bool = False


@dataclass(frozen=True)
class _Item:
    """One array item to export, planned before anything is written."""

    name: str
    saved: ItemManifest
    found: list[OrbaxEntry]  # its leaves under Orbax's names
    copies: list[tuple[_Source, list[ObjectInfo]]]  # the stores to mirror, and their objects
    manifest: Manifest  # the step's: leaves held in part are read through it


async def export(
    src: Backend,
    destination: Target,
    step: int | None,
    item: str | None,
    manager: bool,
    link: bool,
    verify: bool,
    progress: bool | Progress,
) -> ExportResult:
    """`export_orbax` from one backend."""
    started = time.time()
    manifest = await latest_manifest(src, step)
    chosen = choose_items(manifest, item, manager, src.url)  # refuse before writing
    arrays, jsons, composite = chosen.arrays, chosen.jsons, chosen.composite
    todo = [await _plan(src, manifest, name) for name in arrays]
    out = await Destination.open(destination, manifest.step, manager)
    try:
        objects = [o for planned in todo for _, listed in planned.copies for o in listed]
        bar = Progress.make(progress, len(objects), sum(o.size for o in objects), "objects")
        counts = [0, 0, 0]
        handlers = {}
        for planned in todo:
            item_dir = out.item_dir(planned.name if composite else None)
            done = await _write_item(src, planned, out.backend, item_dir, link, verify, bar)
            counts = [a + b for a, b in zip(counts, done, strict=True)]
            if manager or composite:
                await out.backend.write(_join(item_dir, ORBAX_COMMIT_SUCCESS), out.success())
            handlers[planned.name if composite else DEFAULT_ITEM] = HANDLER
        bar.close()
        written = [(n, JSON_FILE, manifest.json_items[n].value) for n in jsons]
        if chosen.metrics is not None:  # where Orbax's CheckpointManager keeps them
            written.append((METRICS_ITEM, METRICS_ITEM, chosen.metrics))
        for name, file, value in written:
            item_dir = out.item_dir(name)
            await out.backend.write(_join(item_dir, file), json.dumps(value).encode())
            await out.backend.write(_join(item_dir, ORBAX_COMMIT_SUCCESS), out.success())
            handlers[name] = JSON_HANDLER
        doc = checkpoint_metadata(
            handlers=dict(sorted(handlers.items())) if composite or manager else None,
            manager=manager,
            started=started,
        )
        await out.backend.write(_join(out.step_dir, ORBAX_CHECKPOINT_METADATA), doc)
        await out.backend.write(_join(out.step_dir, ORBAX_COMMIT_SUCCESS), out.success())  # last
    except BaseException:
        await out.discard()
        raise
    await out.finish()
    return ExportResult(
        step=manifest.step,
        path=out.final,
        leaves=sum(len(p.saved.leaves) for p in todo),
        bytes=sum(p.saved.nbytes for p in todo),
        linked=counts[0],
        copied=counts[1],
        copied_bytes=counts[2],
        items=tuple(sorted([*arrays, *jsons])) if composite else (),
        metrics=chosen.metrics is not None,
    )


async def _plan(src: Backend, manifest: Manifest, name: str) -> _Item:
    saved = manifest.items[name]
    found = entries(saved.structure, saved.leaves)
    sources = await _sources(src, manifest, name)
    copies = [(s, await _objects_to_copy(src, s)) for s in sources]
    return _Item(name, saved, found, copies, manifest)


async def _write_item(
    src: Backend,
    planned: _Item,
    dst: Backend,
    item_dir: str,
    link: bool,
    verify: bool,
    bar: Progress,
) -> tuple[int, int, int]:
    """One array item as an Orbax tree in ``dst/item_dir``: its stores mirrored, its packed
    leaves written, the view built (and read back with ``verify``), its metadata.
    Returns (objects linked, objects copied, bytes copied or written)."""
    counts = [0, 0, 0]
    for source, objects in planned.copies:
        mirror = _join(item_dir, source.mirror)
        done = await _mirror(src, source.where, objects, dst, mirror, link=link, bar=bar)
        counts = [a + b for a, b in zip(counts, done, strict=True)]
    sources = [source for source, _ in planned.copies]
    where_of = {leaf: s.where for s in sources for leaf in s.leaves}
    mirror_of = {leaf: _join(item_dir, s.mirror) for s in sources for leaf in s.leaves}
    saved, found = planned.saved, planned.found
    counts[2] += await _write_packed(src, where_of, dst, item_dir, found, saved)
    counts[2] += await write_in_part(src, planned.manifest, planned.name, dst, item_dir, found)
    # Leaves held in part are in no one mirrored store: written into the view above.
    whole = [e for e in found if e.leaf not in saved.chunk_refs]
    unpacked = [e for e in whole if e.leaf not in saved.packed]
    await _build_view(dst, mirror_of, item_dir, unpacked)
    if verify:
        await _read_back(dst, item_dir, found, saved.leaves)
    keys = array_metadatas(found, saved.leaves)
    if keys is not None:  # typed PRNG keys: their implementation, as Orbax records it
        await dst.write(_join(item_dir, ARRAY_METADATAS, "process_0"), keys)
    await dst.write(_join(item_dir, ORBAX_TREE_METADATA), tree_metadata(found))
    return counts[0], counts[1], counts[2]


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


@dataclass(frozen=True)
class _Source:
    """One item directory the export reads leaves from: the step's own, or (an incremental
    step, docs/incremental.md) the same item of an attempt the step references."""

    where: str  # the item directory
    mirror: str  # where its stores go in the export, relative to the view
    leaves: frozenset[str]  # the step's leaves it holds
    parts: list[str]  # the stores its merged store merged (none: format version 1)
    packs: frozenset[str]  # its pack objects (never copied: `_write_packed`)
    store: bool  # some leaf is read from its merged store (not packed)


async def _sources(src: Backend, manifest: Manifest, item: str) -> list[_Source]:
    """The step's own item directory, and that of each attempt holding leaves it references
    (their parts and packs from the holder's own manifest)."""
    saved = manifest.items[item]
    where = layout.AttemptDir(manifest.step, manifest.attempt).item(item)
    own = frozenset(saved.leaves) - frozenset(saved.refs)
    out = [
        _Source(
            where,
            f"ckptstore.{item}",
            own,
            saved.parts,
            frozenset(f"{where}/{saved.packed[n].key}" for n in own if n in saved.packed),
            any(n not in saved.packed for n in own),
        )
    ]
    for reference, held in manifest.held(item).items():
        k, holder = manifest.references.index(reference), reference.dir
        key = holder.manifest
        try:
            theirs = Manifest.from_bytes(await src.read(key), where=f"{src.url}/{key}")
        except NotFoundError as exc:
            raise CorruptCheckpointError(
                f"step {manifest.step} references attempt {holder.root}, which is missing "
                f"from {src.url}"
            ) from exc
        if (theirs.step, theirs.attempt) != (holder.step, holder.attempt) or item not in (
            theirs.items
        ):
            raise CorruptCheckpointError(
                f"{src.url}/{key} does not describe the item {item!r} of attempt {holder.root}"
            )
        there = theirs.items[item]
        out.append(
            _Source(
                holder.item(item),
                f"ckptstore.{item}.held-{k}",
                held,
                there.parts,
                frozenset(f"{holder.item(item)}/{r.key}" for r in there.packed.values()),
                any(n not in saved.packed for n in held),
            )
        )
    return out


async def _objects_to_copy(src: Backend, source: _Source) -> list[ObjectInfo]:
    """The merged store's own objects and those of every store it merged; nothing else
    (packs neither: their leaves are written into the view, see `_write_packed`).

    A format-version-1 step records no parts: all of its item directory is committed."""
    out = []
    where, parts, packs = source.where, source.parts, source.packs
    stores = tuple(f"{where}/{p}/" for p in parts) if parts else (f"{where}/",)
    async for info in src.list(where):
        rel = info.key[len(where) + 1 :]
        if info.key in packs:
            continue
        if rel == "manifest.ocdbt" or rel.startswith("d/") or info.key.startswith(stores):
            out.append(info)
    if source.store and not any(o.key == f"{where}/manifest.ocdbt" for o in out):
        raise CorruptCheckpointError(f"{src.url}/{where} has no merged store (manifest.ocdbt)")
    return out


async def _write_packed(
    src: Backend,
    where_of: dict[str, str],
    dst: Backend,
    item_dir: str,
    found: list[OrbaxEntry],
    saved: ItemManifest,
) -> int:
    """Packed leaves (`ckptstore.format.packs`) are small: each is read from its pack (checksum
    checked; ``where_of``: the item directory holding each leaf) and written into the view
    as the zarr3 array Orbax reads, a batch at a time. Returns their bytes."""
    view = await ts.KvStore.open(ocdbt_spec(dst.kvstore_spec(item_dir)), context=dst.ts_context)
    packed = [(e, saved.leaves[e.leaf]) for e in found if e.leaf in saved.packed]
    batches = [
        (where, group)
        for where in sorted({where_of[e.leaf] for e, _ in packed if e.leaf is not None})
        for group in chunks.groups(
            [(info, e) for e, info in packed if where_of[info.name] == where], _PACKED_BATCH
        )
    ]
    for where, group in batches:
        refs = [(info, saved.packed[info.name]) for info, _ in group]
        arrays = await read_packed(src, where, refs)

        def encoded(
            group: list[tuple[LeafInfo, OrbaxEntry]] = group,
            arrays: list[Any] = arrays,
        ) -> list[tuple[str, bytes]]:
            out = []
            for (info, e), arr in zip(group, arrays, strict=True):
                renamed = dataclasses.replace(info, name=e.param)
                out.append((chunks.metadata_key(renamed), chunks.encode_metadata(renamed)))
                out.append((chunks.chunk_key(renamed), chunks.encode_chunk(renamed, arr)))
            return out

        writes = await asyncio.to_thread(encoded)
        await asyncio.gather(*(view.write(key, value) for key, value in writes))
    return sum(info.nbytes for _, info in packed)


#: Bytes of packed leaves read and written into an export's view at a time.
_PACKED_BATCH = 64 << 20


async def _mirror(
    src: Backend,
    where: str,
    objects: list[ObjectInfo],
    dst: Backend,
    mirror: str,
    *,
    link: bool,
    bar: Progress,
) -> tuple[int, int, int]:
    """Put every object below ``dst/mirror`` under its path relative to ``where``:
    a hard link where both sides are one local filesystem, else a copy.
    Returns (linked, copied, copied bytes)."""
    budget = ByteBudget(COPY_BUDGET)
    linked = copied = copied_bytes = 0
    can_link = link and isinstance(src, LocalBackend) and isinstance(dst, LocalBackend)

    async def one(info: ObjectInfo) -> None:
        nonlocal linked, copied, copied_bytes, can_link
        rel = info.key[len(where) + 1 :]
        key = f"{mirror}/{rel}"
        if (
            can_link
            and isinstance(src, LocalBackend)
            and isinstance(dst, LocalBackend)
            and not (src.root / info.key).is_symlink()  # a symlink goes through read()
        ):
            target = dst.root / key
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src.root / info.key, target, follow_symlinks=False)
                linked += 1
                bar.advance(1, info.size)
                return
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{src.url}/{info.key} vanished: {exc}") from exc
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                can_link = False  # another filesystem, or links refused: copy from here on
        async with budget.hold(info.size):
            data = await src.read(info.key)
            if len(data) != info.size:
                raise CorruptCheckpointError(
                    f"{src.url}/{info.key} changed size while being copied "
                    f"({info.size} -> {len(data)} bytes)"
                )
            await dst.write(key, data)
            del data
        copied += 1
        copied_bytes += info.size
        bar.advance(1, info.size)

    await asyncio.gather(*(one(o) for o in objects))
    return linked, copied, copied_bytes


async def _build_view(
    dst: Backend, mirror_of: dict[str, str], item_dir: str, found: list[OrbaxEntry]
) -> None:
    """One atomic OCDBT transaction: every leaf's keys copied by reference from the
    mirrored store holding it (``mirror_of``; ``name/...``) to Orbax's names
    (``param/...``), then checked."""
    ctx = dst.ts_context
    source = {m: ocdbt_spec(dst.kvstore_spec(m)) for m in sorted(set(mirror_of.values()))}
    view = ocdbt_spec(dst.kvstore_spec(item_dir))
    leaves = [e for e in found if e.leaf is not None]
    txn = ts.Transaction(atomic=True)
    copies = []
    for e in leaves:
        assert e.leaf is not None
        spec = source[mirror_of[e.leaf]]
        child = await ts.KvStore.open({**spec, "path": f"{e.leaf}/"}, context=ctx)
        dest = await ts.KvStore.open({**view, "path": f"{e.param}/"}, context=ctx)
        copies.append(child.experimental_copy_range_to(dest.with_transaction(txn)))
    await asyncio.gather(*copies)
    await txn.commit_async()
    # The view must hold exactly the source's keys, renamed: nothing lost, nothing extra.
    used = {mirror_of[e.leaf] for e in leaves if e.leaf is not None}
    src_keys = {m: await (await ts.KvStore.open(source[m], context=ctx)).list() for m in used}
    got = set(await (await ts.KvStore.open(view, context=ctx)).list())
    problems = {}
    for e in leaves:
        assert e.leaf is not None
        head, into = f"{e.leaf}/".encode(), f"{e.param}/".encode()
        keys = src_keys[mirror_of[e.leaf]]
        want = {into + k[len(head) :] for k in keys if k.startswith(head)}
        have = {k for k in got if k.startswith(into)}
        if not want or want != have:
            problems[e.leaf or e.param] = (
                f"{len(want)} keys in the checkpoint, {len(have)} under {e.param!r} in the view"
            )
    if problems:
        raise IncompleteCheckpointError(
            f"the Orbax view at {dst.url}/{item_dir} does not match the checkpoint",
            leaves=problems,
        )


async def _read_back(
    dst: Backend, item_dir: str, found: list[OrbaxEntry], leaves: dict[str, LeafInfo]
) -> None:
    """Read every leaf of the view as Orbax will (zarr3, crc32c checked), a slab at a time."""
    view = ocdbt_spec(dst.kvstore_spec(item_dir))
    limit = asyncio.Semaphore(8)

    async def one(e: OrbaxEntry) -> None:
        assert e.leaf is not None
        async with limit:
            spec = {"driver": "zarr3", "kvstore": {**view, "path": f"{e.param}/"}}
            try:
                arr = await ts.open(spec, open=True, read=True, context=dst.ts_context)
            except Exception as exc:  # TensorStore raises ValueError for most failures
                raise CorruptCheckpointError(
                    f"exported array {e.param!r} cannot be opened: {str(exc)[:300]}", leaf=e.leaf
                ) from exc
            await read_all(arr, leaves[e.leaf])

    await settle(one(e) for e in found if e.leaf is not None)
