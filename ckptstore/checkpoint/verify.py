"""Verification: is a committed step intact, and would a restore return exactly what was saved?

`verify` shares the restore's read path (`load_committed`, `RawLeaf`, `open_leaf`, packs)
and the merge's coverage check (`validate`), so it fails exactly where a restore
would fail or return something wrong: a marker, manifest or digest that does not
check out, a manifest whose structure or types a restore cannot rebuild, a
``zarr.json`` that differs from the manifest, a missing chunk, a chunk whose
crc32c does not match, a truncated or missing data file, and a leaf (its own bytes or
bytes it references) whose digest differs from the one its save recorded (a chunk
changed before its checksum was taken passes the checksum).

Damage is told apart from storage that cannot be read at all (a server unreachable or
timing out, permission refused: `StorageError` other than `NotFoundError`, typed from
TensorStore's failures too): those go to ``unreadable``, never to ``problems``, so a
network outage is never reported as a corrupt checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import tensorstore as ts

from ckptstore.backends import supports
from ckptstore.backends.base import Backend
from ckptstore.backends.tserrors import message, storage_error
from ckptstore.checkpoint.merge import validate
from ckptstore.checkpoint.restore import direct_chunks
from ckptstore.checkpoint.verifychunks import verify_in_part, written_regions
from ckptstore.datapath.packs import read_packed
from ckptstore.datapath.rawleaf import RawLeaf
from ckptstore.datapath.reads import Chunks, KvChunks, open_leaf, read_slice
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES, ocdbt_spec
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    CorruptCheckpointError,
    storage_failed,
)
from ckptstore.format import layout
from ckptstore.format.digests import (
    ALGORITHM,
    PieceTable,
    StreamedPiece,
    parse_piece_key,
    piece_size,
)
from ckptstore.format.leaves import Index, LeafInfo, dtype_of
from ckptstore.format.manifest import ItemManifest, Manifest
from ckptstore.protocol import load_committed
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.futures import off_loop

#: Bytes of one leaf read at a time; larger leaves are read in slabs of their first axis.
READ_BYTES = 64 << 20
#: Leaves read concurrently.
CONCURRENCY = 8


@dataclass
class VerifyReport:
    """What `verify` checked and what it found; ``ok`` only if nothing is wrong.

    ``problems``: damage (the stored data is wrong). ``unreadable``: what could not be
    checked because the storage failed (unreachable, timed out, refused); the data may
    be fine. ``unused``: damage in what no restore of the step reads (the merged store of
    an item whose leaves are all packed or held elsewhere): worth repairing, not a wrong
    restore, so ``ok`` stays true.
    """

    step: int
    attempt: str | None = None
    leaves: int = 0  # leaves checked
    bytes: int = 0  # payload bytes read and checksummed
    problems: dict[str, str] = field(default_factory=dict)  # what (file or leaf) -> why
    unreadable: dict[str, str] = field(default_factory=dict)  # what -> the storage's error
    unused: dict[str, str] = field(default_factory=dict)  # what -> why (read by no restore)
    #: On a `Tiered` target: the tier checked ("fast" or "durable"), and the problems of a
    #: damaged fast copy that was skipped for the durable one (a restore would skip it too).
    tier: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unreadable

    def record(self, what: str, exc: BaseException) -> None:
        """File ``exc`` under ``problems`` (damage) or ``unreadable`` (storage failed)."""
        if storage_failed(exc):  # a missing file is damage: the committed step needs it
            self.unreadable[what] = str(exc)
        else:
            self.problems[what] = str(exc)


#: ``progress(bytes_done, bytes_total)``: called as data is read and checked.
ProgressFn = Callable[[int, int], None]


async def verify_step(
    backend: Backend,
    step: int,
    *,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    progress: ProgressFn | None = None,
    held_by: Collection[str] | None = None,
) -> VerifyReport:
    """Check committed ``step`` of ``backend`` end to end; never raises for damage
    (``ckptstore.verify`` opens the target and picks the step).

    At most ``max_inflight_bytes`` of data are read and held at a time (one slab larger
    than that is read alone). ``progress(bytes_done, bytes_total)`` is called as slabs are
    checked. Raises `CheckpointNotFoundError` only if ``step`` is not committed.
    ``held_by`` (attempt roots, ``<step>/<attempt>``): check only the leaves whose bytes
    those attempts hold (an incremental step's own attempt, or one it references); None:
    every leaf."""
    report = VerifyReport(step=step)
    budget = ByteBudget(max_inflight_bytes)
    try:
        manifest = await load_committed(backend, step)
    except CheckpointNotFoundError:
        raise
    except CkptStoreError as exc:
        report.record(f"{step}/{layout.COMMIT_MARKER}", exc)
        return report
    report.attempt = manifest.attempt
    if manifest.attempt is not None:
        roots = [layout.AttemptDir(step, manifest.attempt).root]
        roots += [ref.dir.root for ref in manifest.references]
        for root in roots:  # the attempt, and those holding leaves it references
            for key in await supports.escapes(backend, root):
                report.problems[key] = "leads outside the checkpoint's root (a link): not read"
        if report.problems:
            return report
    done = 0

    def checked(nbytes: int) -> None:  # counts slabs as they are read, unlike report.bytes
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, manifest.nbytes)

    only = None if held_by is None else {root.rstrip("/") + "/" for root in held_by}
    for name in manifest.items:
        await _verify_item(backend, manifest, name, report, budget, checked, only)
    return report


async def _verify_item(
    backend: Backend,
    manifest: Manifest,
    name: str,
    report: VerifyReport,
    budget: ByteBudget,
    checked: Callable[[int], None],
    roots: set[str] | None = None,
) -> None:
    item = manifest.items[name]
    groups: dict[str, list[LeafInfo]] = {}  # per directory holding them (incremental saves)
    for info in item.leaves.values():
        groups.setdefault(manifest.leaf_dir(name, info.name), []).append(info)
    for prefix, infos in groups.items():
        if roots is not None and not any(prefix.startswith(r) for r in roots):
            continue  # held by an attempt not asked for
        shown = name if prefix == manifest.item_dir(name) else prefix
        in_part = {i.name: manifest.holder_dirs(name, i.name) for i in infos}
        in_part = {leaf: dirs for leaf, dirs in in_part.items() if dirs}
        await _verify_leaves(backend, item, prefix, shown, infos, report, budget, checked, in_part)
        report.leaves += len(infos)


async def _verify_leaves(
    backend: Backend,
    item: ItemManifest,
    prefix: str,
    name: str,
    infos: list[LeafInfo],
    report: VerifyReport,
    budget: ByteBudget,
    checked: Callable[[int], None],
    in_part: dict[str, dict[int, str]] | None = None,
) -> None:
    """The leaves ``infos`` of ``item``, held in the item directory ``prefix`` (shown as
    ``name`` in what the report names). ``in_part``: leaves held in part by other attempts
    (chunk references): holder's reference index -> its item directory."""
    in_part = in_part or {}
    spec = ocdbt_spec(backend.kvstore_spec(prefix))
    ctx = backend.ts_context
    in_store = [info for info in infos if info.name not in item.packed]
    try:
        kv = await ts.KvStore.open(spec, context=ctx)
        keys = [k.decode() for k in await kv.list()]
        regions = {leaf: written_regions(item, i) for i in in_store if (leaf := i.name) in in_part}
        # A leaf held whole by other attempts' chunks has nothing in this store to check.
        here = [i for i in in_store if regions.get(i.name) != []]
        coverage = await validate(kv, keys, here, regions)
        # The restore's reader: on local disk, each chunk read straight into a buffer from
        # its data file (`ocdbt_index`), not copied three times through TensorStore's kvstore;
        # elsewhere the store already open here.
        source: Chunks | None = None
        if in_store:  # (a tree of packed leaves only has no chunks in the store to read)
            source = await direct_chunks(backend, prefix)
            if source is None:
                source = KvChunks(kv, ctx)
    except Exception as exc:  # TensorStore raises ValueError for unreadable stores
        failed = storage_error(exc, op=f"reading the merged store {prefix!r}")
        why = f"the merged store cannot be read: {message(exc)}"
        if failed is not None:
            report.unreadable[f"{name}/"] = str(failed)
        elif not in_store:  # every leaf here is packed: a restore never opens this store
            report.unused[f"{name}/"] = why + " (no leaf is read from it)"
        else:
            report.problems[f"{name}/"] = why
        if in_store:
            return
        coverage, source = {}, None
    for leaf, why in coverage.items():
        report.problems[f"{name}/{leaf}"] = why
    todo = iter([info for info in infos if info.name not in coverage])

    async def unpack(info: LeafInfo, table: PieceTable | None) -> int:
        async with budget.hold(info.nbytes):  # the pack's leaf, read whole, then hashed
            (arr,) = await read_packed(backend, prefix, [(info, item.packed[info.name])])
            if table is not None:

                async def read(index: Index) -> Any:
                    return arr[index]

                held = _held(item, info)
                await _check_digests(read, info, table, None, _no, held)
        checked(info.nbytes)
        return info.nbytes

    async def worker() -> None:  # a few workers, not a task per leaf: thousands of leaves
        for info in todo:  # shared: each leaf goes to the next free worker
            try:
                table = _recorded_digests(item, info)
                if info.name in in_part:  # chunks in several stores; held ones by digest
                    assert source is not None
                    holders = {
                        k: await _chunk_source(backend, d) for k, d in in_part[info.name].items()
                    }
                    nbytes = await verify_in_part(item, info, source, holders, budget, checked)
                elif info.name in item.packed:
                    nbytes = await unpack(info, table)
                elif table is not None:  # every byte read and compared with its save's digest
                    assert source is not None  # a leaf not packed is in the store
                    read = await _store_reader(spec, ctx, source, info)
                    held = _held(item, info)
                    nbytes = await _check_digests(read, info, table, budget, checked, held)
                else:
                    assert source is not None  # a leaf not packed is in the store
                    nbytes = await _read_all(spec, ctx, source, info, budget, checked)
                report.bytes += nbytes  # not `+= await`: that would add to a stale total
            except CkptStoreError as exc:
                report.record(f"{name}/{info.name}", exc)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def _recorded_digests(item: ItemManifest, info: LeafInfo) -> PieceTable | None:
    """The digests its save recorded for leaf ``info`` (an incremental save's, or any
    save's that records them), if of this version's algorithm and covering the leaf once:
    its bytes, its own or another attempt's, are compared with them. A reference can be
    pointed anywhere by a forged manifest, and a chunk damaged before its checksum was
    taken passes that checksum: only the digests say what was saved."""
    table = item.digests.get(info.name)
    if table is None or item.digest_algorithm != ALGORITHM:
        return None
    if info.name in item.refs:  # no other way to know the bytes are the saved ones
        return table
    try:
        covered = sum(piece_size(parse_piece_key(key), info.shape) for key in table)
    except ValueError:  # bounds of another rank: `_check_digests` names them
        return table
    return table if covered == math.prod(info.shape) else None  # else read whole, by crc32c


async def _chunk_source(backend: Backend, prefix: str) -> Chunks:
    """A reader of the chunks of the merged store at ``prefix`` (as a restore reads them)."""
    source = await direct_chunks(backend, prefix)
    if source is not None:
        return source
    spec = ocdbt_spec(backend.kvstore_spec(prefix))
    return KvChunks(await ts.KvStore.open(spec, context=backend.ts_context), backend.ts_context)


def _held(item: ItemManifest, info: LeafInfo) -> str:
    """What holds ``info``'s bytes, as a problem names it."""
    return "the bytes it references" if info.name in item.refs else "its bytes"


def _no(nbytes: int) -> None:
    """Progress not reported (bytes counted by the caller)."""


async def _store_reader(
    spec: dict[str, Any], ctx: ts.Context, source: Chunks, info: LeafInfo
) -> Callable[[Index], Awaitable[Any]]:
    """A function reading a region of a leaf in the store as a restore reads it: chunks
    straight from ``source`` where `RawLeaf` can, else through TensorStore."""
    raw = await RawLeaf.open(source, info)
    if raw is not None:
        return raw.read
    opened = await open_leaf(spec, ctx, info)

    async def from_store(index: Index) -> Any:
        return await read_slice(opened, index, info.name)

    return from_store


async def _check_digests(
    read: Callable[[Index], Awaitable[Any]],
    info: LeafInfo,
    table: PieceTable,
    budget: ByteBudget | None,
    checked: Callable[[int], None],
    held: str,
) -> int:
    """Read the leaf piece by piece as its saver digested it, each piece in slabs of at
    most `READ_BYTES` (`StreamedPiece`), and compare each piece's digest with the recorded
    one; `CorruptCheckpointError` on the first that differs, naming ``held`` (what holds
    the bytes). Each slab is held in ``budget`` (None: the caller holds them all). Returns
    the bytes read."""
    itemsize = dtype_of(info.dtype).itemsize
    total = 0
    for key, want in table.items():
        index = parse_piece_key(key)
        if len(index) != len(info.shape):
            raise CorruptCheckpointError(f"leaf {info.name!r}: digest of bad bounds {key!r}")
        piece = StreamedPiece(index, info.shape, info.chunk_shape, itemsize, READ_BYTES)
        for slab in piece.slabs:
            nbytes = itemsize * piece_size(slab, info.shape)
            async with budget.hold(nbytes) if budget else contextlib.nullcontext():
                data = await read(slab)
                await off_loop(functools.partial(piece.add, data), nbytes)
            checked(nbytes)
            total += nbytes
        if piece.hexdigest() != want:
            raise CorruptCheckpointError(
                f"leaf {info.name!r}: {held} (piece {key or 'all'}) are not the ones its "
                "save recorded (their digest differs)"
            )
    return total


async def _read_all(
    spec: dict[str, Any],
    ctx: ts.Context,
    source: Chunks,
    info: LeafInfo,
    budget: ByteBudget,
    checked: Callable[[int], None],
) -> int:
    """Read every byte of a leaf through the restore's path (chunks from ``source``), a
    slab at a time, each slab held in ``budget`` while it is read and checked (and then
    passed to ``checked``)."""
    read = await _store_reader(spec, ctx, source, info)
    if not info.shape or info.nbytes <= READ_BYTES:
        async with budget.hold(info.nbytes):
            await read(())
        checked(info.nbytes)
        return info.nbytes
    row_bytes = max(1, info.nbytes // info.shape[0])
    rows = max(1, READ_BYTES // row_bytes)
    rows = math.ceil(rows / info.chunk_shape[0]) * info.chunk_shape[0]  # whole chunks only
    for start in range(0, info.shape[0], rows):
        async with budget.hold(min(rows, info.shape[0] - start) * row_bytes):
            await read((slice(start, start + rows),))
        checked(min(rows, info.shape[0] - start) * row_bytes)
    return info.nbytes
