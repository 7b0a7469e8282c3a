"""Deleting steps and collecting garbage, without ever touching what a reader relies on.

- `remove_step` (``ckptstore.delete_step`` on one backend) revokes the commit it read
  first (the step vanishes atomically from every listing; `commit.revoke`: a stale
  deletion never reaches a newer commit of the step), then removes the attempt it
  named. Killed in between, it leaves an uncommitted attempt, which `gc` removes later.
- `collect` (``ckptstore.gc`` on one backend) removes what no commit marker names:
  uncommitted attempts, leftovers of format-version-1 saves that never committed, part
  directories a committed attempt does not use, and the temporary files of writes
  killed midway (local disk: `SupportsTemporaries.remove_temporaries`). Only what nobody has
  written to for ``older_than`` seconds goes, and never anything a committed attempt's
  manifest lists under ``references``.

Commit protocol v3: `gc` deletes an undecided attempt only after winning its fate
(`Attempt.claim`, "collect"), so a writer that was merely slow (any grace, 0
included) fails its commit with `FencedError` instead of committing what gc
deleted. An attempt claimed for a commit that never came is kept for
`fates.CLAIM_TTL`; the fate record of a collected or abandoned attempt stays
that long too, as a tombstone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ckptstore.backends import supports
from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.checkpoint.stagedrecord import STAGED, read_staged
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    CorruptCheckpointError,
    FencedError,
    NotFoundError,
)
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import (
    COLLECT,
    Attempt,
    Marker,
    committed_steps,
    fates,
    load_manifest,
    new_owner,
    read_marker,
    read_marker_bytes,
    revoke,
)

log = logging.getLogger("ckptstore")

DEFAULT_GRACE = 6 * 3600.0  # seconds
DELETE, TRIM = "delete", "trim"  # why an attempt's DELETED record was written


@dataclass
class Entry:
    """One top-level entry of a step directory (an attempt, or a version-1 file or item)."""

    step: int
    name: str  # the attempt id, or a version-1 name ("manifest.json", "state")
    committed: bool  # named by the step's marker (or version-1 content of a committed step)
    objects: list[ObjectInfo] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.step}/{self.name}"

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def idle_for(self, now: float) -> float | None:
        """Seconds since anything below was written; None if the backend cannot tell."""
        return idle_seconds(self.objects, now)


@dataclass
class StepScan:
    """What is stored under one step directory."""

    step: int
    marker: Marker | None
    marker_error: str | None  # the marker exists but cannot be read
    entries: list[Entry]
    index: int = 0  # the current marker's (`protocol.StepRecords`), read or not
    #: The step's commit and revocation records (`layout.parse_step_record`), current or not.
    records: list[ObjectInfo] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.marker is not None or self.marker_error is not None

    @property
    def orbax(self) -> bool:
        """An uncommitted step directory holding Orbax's files (`layout.ORBAX_FILES`): an
        Orbax `CheckpointManager` step, finalized or being written, never ckptstore garbage."""
        if self.committed:
            return False
        for entry in self.entries:
            if entry.name in layout.ORBAX_FILES:
                return True
            if any(_orbax_item_file(entry, o.key) for o in entry.objects):
                return True
        return False


async def scan(backend: Backend) -> list[StepScan]:
    """Every step directory with its marker and entries, ascending."""
    steps = sorted(
        s for s in (layout.parse_step(n) for n in await backend.list_dir()) if s is not None
    )
    return list(await asyncio.gather(*(scan_step(backend, s) for s in steps)))


async def scan_marker(backend: Backend, step: int) -> StepScan:
    """``step``'s marker (or why it cannot be read), without listing its entries."""
    try:
        found = await read_marker_bytes(backend, step)
    except CorruptCheckpointError as exc:
        return StepScan(step, None, str(exc), [])
    if found is None:
        return StepScan(step, None, None, [])
    index, data = found
    where = f"{backend.url}/{layout.commit_key(step, index)}"
    try:
        marker = Marker.from_bytes(data, step=step, where=where, index=index)
    except CorruptCheckpointError as exc:
        return StepScan(step, None, str(exc), [], index)
    return StepScan(step, marker, None, [], index)


async def scan_step(backend: Backend, step: int) -> StepScan:
    head = await scan_marker(backend, step)
    marker, error = head.marker, head.marker_error
    groups: dict[str, list[ObjectInfo]] = defaultdict(list)
    records = []
    async for info in backend.list(layout.step_dir(step)):
        name = info.key.split("/")[1]
        if layout.parse_step_record(name) is not None:
            records.append(info)
        else:
            groups[name].append(info)
    entries = []
    for name, objects in sorted(groups.items()):
        if marker is None:
            committed = error is not None  # unreadable marker: keep everything
        elif marker.attempt is None:
            committed = not layout.is_attempt(name)
        else:
            committed = name == marker.attempt
        entries.append(Entry(step, name, committed, objects))
    return StepScan(step, marker, error, entries, head.index, records)


@dataclass
class Removal:
    """What `delete_step` or `gc` removed (or, on a dry run, would remove)."""

    entries: list[str] = field(default_factory=list)  # keys of removed entries
    objects: int = 0
    bytes: int = 0
    kept_young: list[str] = field(default_factory=list)  # garbage left for being too recent
    #: Attempts of a deleted step kept because another step references them (their
    #: marker went; the bytes stay until the last referencing step goes, then `gc`).
    kept_referenced: list[str] = field(default_factory=list)

    def add(self, key: str, objects: list[ObjectInfo]) -> None:
        self.entries.append(key)
        self.objects += len(objects)
        self.bytes += sum(o.size for o in objects)

    def absorb(self, other: Removal, where: str) -> None:
        """Add what ``other`` removed on the backend at URL ``where`` (keys become URLs)."""
        self.entries += [f"{where}/{key}" for key in other.entries]
        self.kept_young += [f"{where}/{key}" for key in other.kept_young]
        self.kept_referenced += [f"{where}/{key}" for key in other.kept_referenced]
        self.objects += other.objects
        self.bytes += other.bytes


async def _remove(backend: Backend, key: str, objects: list[ObjectInfo]) -> None:
    """Remove one entry: a lone object, or everything below a prefix."""
    if len(objects) == 1 and objects[0].key == key:
        await backend.delete(key)
    else:
        await backend.delete_prefix(key)


async def _referenced(
    backend: Backend, scans: Sequence[StepScan], ignore: Collection[int] = ()
) -> set[tuple[int, str]]:
    """(step, attempt) pairs some committed attempt (as ``scans`` found them) or some
    save in flight references (besides its own). The saves in flight are looked for
    after the markers in ``scans`` were read (docs/incremental.md: why that order).
    The steps in ``ignore`` count as deleted: what they reference is not counted."""
    out: set[tuple[int, str]] = set()
    seen: set[tuple[int, str]] = set()
    for s in scans:
        if s.step in ignore:
            if s.marker is not None and s.marker.attempt is not None:
                seen.add((s.step, s.marker.attempt))
            continue
        if s.marker_error is not None:
            raise CorruptCheckpointError(
                f"step {s.step}'s commit marker is unreadable ({s.marker_error}); "
                f"cannot tell what it references: remove it with `ckptstore rm --step {s.step}`"
            )
        if s.marker is None or s.marker.attempt is None:
            continue
        seen.add((s.step, s.marker.attempt))
        try:
            manifest: Manifest = await load_manifest(backend, s.marker)
        except CorruptCheckpointError:
            # Deleted since its marker was read (a deletion removes the marker before the
            # attempt): what it referenced, the saves that still need it hold themselves.
            if await _still_names(backend, s.step, s.marker.attempt):
                raise
            continue
        for ref in manifest.references:
            out.add((ref.step, ref.attempt))
    return out | await _in_flight(backend, seen)


async def _still_names(backend: Backend, step: int, attempt: str) -> bool:
    """Whether ``step``'s marker (read again) still names ``attempt``."""
    try:
        marker = await read_marker(backend, step)
    except CorruptCheckpointError:
        return True
    return marker is not None and marker.attempt == attempt


async def _in_flight(backend: Backend, seen: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """What attempts not in ``seen`` reference, listed now: saves that wrote their
    manifest and may still commit (their fate is a commit claim younger than
    `fates.CLAIM_TTL`, or undecided), and steps committed since ``seen`` was read."""
    out: set[tuple[int, str]] = set()
    steps = sorted(
        s for s in (layout.parse_step(n) for n in await backend.list_dir()) if s is not None
    )
    for step in steps:
        for name in await backend.list_dir(layout.step_dir(step)):
            if not layout.is_attempt(name) or (step, name) in seen:
                continue
            where = layout.AttemptDir(step, name)
            try:
                data = await backend.read(where.manifest)
            except NotFoundError:
                continue  # still writing (or not a save's): it references nothing yet
            try:
                fate = await Attempt(backend, where).fate()
            except CorruptCheckpointError:
                fate = None  # cannot tell: count its references
            if fate is not None and (fate.dead or time.time() - fate.time >= fates.CLAIM_TTL):
                continue  # it will never commit
            if await backend.exists(where.deleted):
                continue  # a deleted step's: what it referenced, its referrers list too
            try:
                manifest = Manifest.from_bytes(data, where=f"{backend.url}/{where.manifest}")
            except CorruptCheckpointError:
                continue  # a save writes none a reader refuses: nothing will read it
            for ref in manifest.references:
                out.add((ref.step, ref.attempt))
    return out


async def referenced_elsewhere(
    backend: Backend, step: int, *, deleted: Collection[int] = ()
) -> set[tuple[int, str]]:
    """The attempts that the committed steps other than ``step`` (and other than those in
    ``deleted``, which a dry run takes as removed already) or saves in flight reference:
    what a deletion of ``step`` keeps (`remove_step`, ``ckptstore rm --dry-run``)."""
    others = [s for s in await committed_steps(backend) if s != step]
    scans = await asyncio.gather(*(scan_marker(backend, s) for s in others))
    return await _referenced(backend, scans, ignore=deleted)


async def remove_step(
    backend: Backend,
    step: int,
    *,
    tombstone: bool = False,
    reason: str = DELETE,
    attempt: str | None = None,
) -> Removal:
    """Record the deletion in the attempt (``DELETED``: the attempt is dead, for `gc` if
    this is killed midway, and for a promotion in flight), revoke the commit this call
    read (`commit.revoke`), then remove the attempt; the records last, or (``tombstone``)
    not at all. With ``attempt``, only a commit of that attempt is deleted."""
    scanned = await scan_step(backend, step)
    named = scanned.marker.attempt if scanned.marker is not None else None
    if not scanned.committed or (attempt is not None and named != attempt):
        raise CheckpointNotFoundError(
            f"step {step} is not committed" + (f" from attempt {attempt}" if attempt else ""),
            backend=backend.url,
            key=layout.commit_key(step),
        )
    keep: set[tuple[int, str]] = set()
    if scanned.marker is not None and scanned.marker.attempt is not None:
        # Marked first, references read after: a save referencing this step that checked
        # it before the mark wrote its manifest before, and is found (docs/incremental.md).
        await mark_deleted(backend, scanned.marker.where, reason)
        keep = await referenced_elsewhere(backend, step)
    removal = Removal()
    await revoke(backend, step, scanned.index, named)  # from here on, the step is gone
    removal.entries.append(layout.commit_key(step, scanned.index))
    removal.objects += 1
    for entry in scanned.entries if scanned.marker is not None else []:
        if entry.committed and (step, entry.name) in keep:
            removal.kept_referenced.append(entry.key)
        elif entry.committed:
            if layout.is_attempt(entry.name):
                where = layout.AttemptDir(step, entry.name)
                await Attempt(backend, where).clear(keep_fate=tombstone)
            else:
                await _remove(backend, entry.key, entry.objects)
            removal.add(entry.key, entry.objects)
    await supports.prune_dirs(backend, layout.step_dir(step))  # gone unless a tombstone stays
    return removal


async def trim_step(fast: Backend, step: int) -> Removal:
    """Delete promoted ``step`` from a fast tier (``keep_fast``): as `delete_step`, but the
    deletion record says "trim", which a promotion in flight does not take for a user's
    deletion (its durable copy is the one that stays)."""
    return await remove_step(fast, layout.check_step(step), reason=TRIM)


async def mark_deleted(backend: Backend, where: layout.AttemptDir, reason: str) -> None:
    """Create the attempt's ``DELETED`` record: ``reason`` is `DELETE` (a user's
    `delete_step`, which a promotion in flight honours) or `TRIM` (a promoted step leaving
    the fast tier, which it must not)."""
    try:
        await backend.create(where.deleted, json.dumps({"reason": reason}).encode())
    except AlreadyExistsError:
        pass


async def deleted_by_user(backend: Backend, where: layout.AttemptDir) -> bool:
    """Whether a `delete_step` (not a trim) recorded the attempt's deletion."""
    try:
        doc = json.loads(await backend.read(where.deleted))
    except NotFoundError:
        return False
    except ValueError:
        return True  # unreadable: the safe answer for a promotion is "deleted"
    return not (isinstance(doc, dict) and doc.get("reason") == TRIM)


def check_grace(older_than: float) -> None:
    """Refuse a negative grace period before anything is scanned (``ckptstore.gc``)."""
    if older_than < 0:
        raise CkptStoreError(f"older_than must be >= 0 seconds, got {older_than}")


async def collect(backend: Backend, older_than: float, dry_run: bool) -> Removal:
    """Remove from ``backend`` uncommitted attempts and unused parts nobody wrote to for
    ``older_than`` s (its caller has checked that with `check_grace`), and expired
    records; only list them when ``dry_run``. ``older_than=0`` collects regardless of age
    (only when no writer can be running); where a backend cannot tell when an object was
    written, it is never collected unless ``older_than`` is 0. (``ckptstore.gc`` opens
    the target, and collects both tiers of a `Tiered` one: `ckptstore.tiers.cleanup`.)"""
    scans = await scan(backend)
    keep = await _referenced(backend, scans) | await _staged(backend, scans)
    now = time.time()
    removal = Removal()
    owner = new_owner()
    for s in scans:
        garbage = [e for e in s.entries if not e.committed and (s.step, e.name) not in keep]
        for entry in [e for e in garbage if layout.is_attempt(e.name)]:
            await _collect_attempt(backend, entry, older_than, now, dry_run, owner, removal)
        # Not a version-1 leftover: an Orbax step (gc on an Orbax root keeps every one).
        others = (
            []
            if s.orbax
            else [(e.key, e.objects) for e in garbage if not layout.is_attempt(e.name)]
        )
        if s.marker is not None and s.marker.attempt is not None:
            others += await _unused_parts(backend, s)
        for key, objects in _expired_records(s, now):
            if not dry_run:
                await backend.delete(key)
            removal.add(key, objects)
        for key, objects in others:
            idle = idle_seconds(objects, now)
            if older_than > 0 and (idle is None or idle < older_than):
                removal.kept_young.append(key)
                continue
            if not dry_run:
                await _remove(backend, key, objects)
            removal.add(key, objects)
    removed = tuple(f"{key}/" for key in removal.entries)
    temporaries = await supports.remove_temporaries(backend, older_than, dry_run=dry_run)
    for info in temporaries:
        if not info.key.startswith(removed):  # else part of an entry named already
            removal.add(info.key, [info])
    if not dry_run:
        # Step directories left empty: by what was removed above, or before (a step
        # deleted by an older version). rmdir only: a writer's new entry keeps its directory.
        empty = {layout.step_dir(s.step) for s in scans if not s.committed}
        empty |= {info.key.rpartition("/")[0] for info in temporaries if "/" in info.key}
        for prefix in sorted(empty):
            await supports.prune_dirs(backend, prefix)
    return removal


async def _collect_attempt(
    backend: Backend,
    entry: Entry,
    older_than: float,
    now: float,
    dry_run: bool,
    owner: str,
    removal: Removal,
) -> None:
    """One uncommitted attempt: collected once gc wins its fate (an undecided one idle for
    ``older_than``), or once it is dead (abandoned, collected: then only its tombstone
    stays, until `CLAIM_TTL`), or once a commit claim on it is older than `CLAIM_TTL`."""
    where = layout.AttemptDir(entry.step, entry.name)
    attempt = Attempt(backend, where, owner)
    records = {f"{where.root}/{name}" for name in layout.TOMBSTONES}
    data = [o for o in entry.objects if o.key not in records]
    try:
        fate = await attempt.fate() if len(data) < len(entry.objects) else None
    except CorruptCheckpointError as exc:
        log.warning("gc keeps %s: %s", where.root, exc)
        removal.kept_young.append(entry.key)
        return
    idle = idle_seconds(data, now) if data else float("inf")
    if older_than > 0 and (idle is None or idle < older_than):
        removal.kept_young.append(entry.key)
        return
    deleted = any(o.key == where.deleted for o in entry.objects)  # a delete_step killed midway
    if fate is None and not deleted and data:
        if not dry_run:
            try:
                await attempt.claim(COLLECT)
            except FencedError:  # a writer decided it first: its to commit or remove
                removal.kept_young.append(entry.key)
                return
            await attempt.clear(keep_fate=True)
        removal.add(entry.key, data)
        return
    dead = deleted or (fate is not None and fate.dead)
    decided = fate.time if fate is not None else 0.0  # no fate record: nothing to wait for
    if dead and data:  # a dead attempt's late writes
        if not dry_run:
            await attempt.clear(keep_fate=True)
        removal.add(entry.key, data)
    elif now - decided >= fates.CLAIM_TTL:  # a tombstone, or a claim never committed
        if not dry_run:
            await attempt.clear(keep_fate=False)
        removal.add(entry.key, entry.objects)
    else:
        removal.kept_young.append(entry.key)


def _expired_records(s: StepScan, now: float) -> list[tuple[str, list[ObjectInfo]]]:
    """Revocations older than `fates.CLAIM_TTL` (no stale deletion can still name their
    commit), each after the void marker of the same index if one is left: in that order."""
    names = {info.key.split("/")[1]: info for info in s.records}
    out = []
    for name, info in sorted(names.items()):
        record = layout.parse_step_record(name)
        if record is None or record[0] != layout.REVOKED:
            continue
        if info.mtime is None or now - info.mtime < fates.CLAIM_TTL:
            continue
        marker = names.get(layout.commit_key(s.step, record[1]).split("/")[1])
        if marker is not None:
            out.append((marker.key, [marker]))
        out.append((info.key, [info]))
    return out


async def _unused_parts(backend: Backend, s: StepScan) -> list[tuple[str, list[ObjectInfo]]]:
    """Part directories inside a committed attempt that its merged stores do not use."""
    assert s.marker is not None and s.marker.attempt is not None
    try:
        manifest = await load_manifest(backend, s.marker)
    except CorruptCheckpointError:
        if await _still_names(backend, s.step, s.marker.attempt):
            raise
        return []  # deleted since its marker was read: the deletion removes its parts
    root = layout.AttemptDir(s.step, s.marker.attempt).root
    used = {
        f"{name}/{part.split('/')[0]}"
        for name, item in manifest.items.items()
        for part in item.parts
    }
    groups: dict[str, list[ObjectInfo]] = defaultdict(list)
    for entry in s.entries:
        if entry.name != s.marker.attempt:
            continue
        for info in entry.objects:
            rel = info.key.removeprefix(root + "/").split("/")
            if len(rel) > 2 and rel[1].startswith("pending_") and f"{rel[0]}/{rel[1]}" not in used:
                groups[f"{root}/{rel[0]}/{rel[1]}"].append(info)
    return sorted(groups.items())


async def _staged(backend: Backend, scans: Sequence[StepScan]) -> set[tuple[int, str]]:
    """(step, entry) of staged steps on a host-local fast tier (`hostlocal`): the ``STAGED``
    marker and the attempt it names, which hold this host's part (maybe not promoted yet)
    and its copy for a restart; `hostlocal.drop_staged` and ``keep_fast`` remove them. An
    unreadable marker keeps the whole step."""
    keep: set[tuple[int, str]] = set()
    for s in scans:
        if s.committed or not any(e.name == STAGED for e in s.entries):
            continue
        try:
            mine = await read_staged(backend, s.step)
        except CorruptCheckpointError:
            keep |= {(s.step, e.name) for e in s.entries}
            continue
        keep.add((s.step, STAGED))
        if mine is not None:
            keep.add((s.step, mine.attempt))
    return keep


def _orbax_item_file(entry: Entry, key: str) -> bool:
    """Whether ``key`` is an Orbax file directly inside item directory ``entry``."""
    parts = key.split("/")
    return len(parts) == 3 and parts[2] in layout.ORBAX_FILES and not layout.is_attempt(entry.name)


def idle_seconds(objects: list[ObjectInfo], now: float) -> float | None:
    """Seconds since the newest of ``objects`` was written; None if any time is unknown."""
    times = [o.mtime for o in objects]
    if not times or any(t is None for t in times):
        return None
    return now - max(t for t in times if t is not None)
