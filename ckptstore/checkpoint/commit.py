"""The commit protocol (v3): attempts, their fates, the marker, the digest, read-side checks.

Writers: a save (or a partial-save session) writes only below its own attempt
directory ``<step>/<attempt>/``; nothing outside it is ever deleted or
overwritten. The commit is one create-if-absent of ``<step>/COMMITTED``, naming
the attempt and carrying the sha256 of that attempt's ``manifest.json``: the
first writer to create it wins, every other gets `AlreadyExistsError`.

Fates (v3): several actors may share one attempt (a partial-save session and its
zombie, ``abandon``, ``gc``). Whoever would commit, abandon or collect an attempt
first *claims its fate*: one create-if-absent of ``<attempt>/FATE``. Exactly one
actor wins; every other gets `FencedError` before its first write (a committer
claims before it merges, so a loser never rebuilds a store someone committed). Once
decided, a fate never changes: only the winner writes or deletes below the attempt,
and after the commit only ``delete_step``. See `claim`.

Markers are superseded, never taken back (v3, closed): a deletion creates
``<step>/REVOKED.<n>`` for the commit it read (``COMMITTED`` is n = 0), and only then
removes that marker; a later save of the step creates ``COMMITTED.<n+1>``. No key a
deleter removes can name a newer commit, so a stale deletion (one that read an older
marker) never removes a re-saved step. `StepRecords` says which commit is current.

Readers start from the marker and trust nothing they have not checked: the marker
must parse and name this step; the manifest it points to must have the digest it
carries and name the same step and attempt. Anything else is
`CorruptCheckpointError`, never data from another step or attempt.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import math
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ckptstore.backends import supports
from ckptstore.backends.base import Backend
from ckptstore.errors import (
    AlreadyExistsError,
    BaseStepGoneError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedError,
    InvalidKeyError,
    NotFoundError,
)
from ckptstore.format import layout
from ckptstore.format.layout import AttemptDir
from ckptstore.format.manifest import Manifest, Reference
from ckptstore.runtime.futures import THREAD_BYTES, gather_first_error, off_loop


def digest(data: bytes) -> str:
    """The digest a marker carries for its manifest."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Marker:
    """The content of ``<step>/COMMITTED``. ``attempt`` is None for a version-1 step."""

    step: int
    attempt: str | None
    manifest_digest: str | None
    token: str = ""
    time: float = 0.0
    #: The format version the marker says (that of its manifest: `layout.PLAIN_VERSION`
    #: unless the step references other attempts).
    format_version: int = layout.PLAIN_VERSION
    #: Which of the step's commits this is (`StepRecords`; not stored in the marker).
    index: int = field(default=0, compare=False)

    @property
    def key(self) -> str:
        return layout.commit_key(self.step, self.index)

    @property
    def where(self) -> AttemptDir:
        return AttemptDir(self.step, self.attempt)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": layout.FORMAT,
                "format_version": self.format_version,
                "step": self.step,
                "attempt": self.attempt,
                "manifest_digest": self.manifest_digest,
                "token": self.token,  # unique: a retried create recognizes its own marker
                "time": self.time,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, step: int, where: str, index: int = 0) -> Marker:
        marker = cls._parse(data, step=step, where=where)
        return dataclasses.replace(marker, index=index)

    @classmethod
    def _parse(cls, data: bytes, *, step: int, where: str) -> Marker:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("step") != step or isinstance(doc.get("step"), bool):
                raise ValueError(f"it names step {doc.get('step')!r}")
            if "attempt" not in doc:  # format version 1: the step directory is the attempt
                return cls(step=step, attempt=None, manifest_digest=None)
            attempt, dig = doc["attempt"], doc["manifest_digest"]
            if doc.get("format") != layout.FORMAT or not isinstance(attempt, str):
                raise ValueError("not a ckptstore commit marker")
            version = doc.get("format_version")
            if not isinstance(version, int) or version > layout.FORMAT_VERSION:
                raise ValueError(f"format version {version!r} is newer than this ckptstore reads")
            if not layout.is_attempt(attempt):
                raise ValueError(f"it names no valid attempt ({attempt[:80]!r})")
            if not isinstance(dig, str) or not dig.startswith("sha256:") or len(dig) != 71:
                raise ValueError("bad manifest digest")
            when = doc.get("time", 0.0)  # informational: `ckptstore info` derives the commit's
            if isinstance(when, bool) or not isinstance(when, (int, float)):  # duration
                when = 0.0
            when = float(when) if math.isfinite(when) else 0.0
            return cls(step=step, attempt=attempt, manifest_digest=dig, time=when)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable commit marker {where}: {exc}") from exc


# ---- fates (v3) ----

COMMIT, ABANDON, COLLECT = "commit", "abandon", "collect"
_FATES = {COMMIT: "claimed for its commit", ABANDON: "abandoned", COLLECT: "garbage-collected"}
#: A commit claim that has no marker after this long may be collected (its owner died
#: between the claim and the marker); the owner itself refuses to create the marker once
#: half of it has passed since it claimed (`Fate.check_fresh`). The fate record of an
#: abandoned or collected attempt (its tombstone) stays as long, so that a writer that
#: stalled past a garbage collection still finds the attempt decided.
CLAIM_TTL = 24 * 3600.0


@dataclass(frozen=True)
class Fate:
    """The content of ``<attempt>/FATE``: what was decided, by whom (a token unique to the
    deciding actor) and when."""

    kind: str  # COMMIT, ABANDON or COLLECT
    owner: str
    time: float
    #: `time.monotonic()` on the winning process when it claimed (not stored).
    claimed_at: float = field(default=0.0, compare=False)

    @property
    def dead(self) -> bool:
        """Abandoned or collected: nobody will ever commit the attempt."""
        return self.kind != COMMIT

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.time))
        return f"{_FATES[self.kind]} by another actor at {when}"

    def to_bytes(self) -> bytes:
        return json.dumps({"fate": self.kind, "owner": self.owner, "time": self.time}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Fate:
        try:
            doc = json.loads(data)
            kind, owner, when = doc["fate"], doc["owner"], doc["time"]
            if kind not in _FATES or not isinstance(owner, str):
                raise ValueError(f"unknown fate {kind!r}")
            if isinstance(when, bool) or not isinstance(when, (int, float)):
                raise ValueError("its time is not a number")
            return cls(kind, owner, float(when))
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable fate record {where}: {exc}") from exc

    def check_fresh(self, where: AttemptDir) -> None:
        """Refuse to commit on a claim old enough that `gc` may soon collect it."""
        if time.monotonic() - self.claimed_at > CLAIM_TTL / 2:
            raise FencedError(
                f"attempt {where.root} was claimed for its commit more than "
                f"{CLAIM_TTL / 7200:.0f} h ago; not committed (gc may be collecting it)"
            )


def new_owner() -> str:
    """A token naming one actor in fate records."""
    return secrets.token_hex(16)


async def read_fate(backend: Backend, where: AttemptDir) -> Fate | None:
    """The attempt's fate, or None while undecided."""
    try:
        data = await backend.read(where.fate)
    except NotFoundError:
        return None
    return Fate.from_bytes(data, f"{backend.url}/{where.fate}")


async def claim(backend: Backend, where: AttemptDir, kind: str, owner: str) -> Fate:
    """Decide the attempt's fate as ``kind`` for ``owner``: one create-if-absent.

    Returns the fate if this call created it, or if ``owner`` had already decided it the
    same way (a retry), or claimed it for a commit and now abandons it. Raises
    `FencedError` if another actor decided first; the caller must
    then write nothing more below the attempt.
    """
    fate = Fate(kind, owner, time.time(), time.monotonic())
    try:
        await backend.create(where.fate, fate.to_bytes())
        return fate
    except AlreadyExistsError:
        pass
    try:
        existing = await read_fate(backend, where)
    except CorruptCheckpointError as exc:
        raise FencedError(
            f"attempt {where.root} has a fate record that cannot be read: {exc}",
            backend=backend.url,
            key=where.fate,
        ) from exc
    if existing is not None and existing.owner == owner:
        # The same actor again: a retry of the same decision, or the abandon of its own
        # commit claim after the commit failed (it alone could have committed).
        if existing.kind == kind or (existing.kind == COMMIT and kind == ABANDON):
            elapsed = max(0.0, time.time() - existing.time)
            return dataclasses.replace(existing, claimed_at=time.monotonic() - elapsed)
    if existing is None:
        shown = "decided and removed meanwhile"
    elif existing.owner == owner:
        shown = f"{_FATES[existing.kind]} by this same actor"
    else:
        shown = existing.describe()
    raise FencedError(
        f"attempt {where.root} was already {shown}; {kind} refused",
        backend=backend.url,
        key=where.fate,
    )


async def clear_attempt(backend: Backend, where: AttemptDir, *, keep_fate: bool) -> int:
    """Delete everything below the attempt (its tombstone records, the fate and a
    deletion record, last, or not at all with ``keep_fate``: what a stalled writer of a
    collected attempt, or a promotion of a deleted step, finds). Only the winner of the
    attempt's fate (or ``delete_step``, for a committed one) calls this. Returns the
    number of objects removed."""
    groups: dict[str, list[str]] = defaultdict(list)
    async for info in backend.list(where.root):
        groups[info.key.removeprefix(where.root + "/").split("/")[0]].append(info.key)
    removed = 0
    for name, keys in sorted(groups.items()):
        key = f"{where.root}/{name}"
        if name in layout.TOMBSTONES:
            continue
        if keys == [key]:
            await backend.delete(key)
        else:
            await backend.delete_prefix(key)
        removed += len(keys)
    if not keep_fate:
        for name in layout.TOMBSTONES:
            if name in groups:
                await backend.delete(f"{where.root}/{name}")
                removed += 1
        # Only empty directories are left: pruned, never deleted blindly (once the records
        # are gone a promotion may claim the attempt afresh and copy a holder into it).
        await supports.prune_dirs(backend, where.root)
    return removed


# ---- writers ----


@dataclass(frozen=True)
class StepRecords:
    """A step's commit markers and revocations, as one listing of its directory found them.

    The current commit is the highest marker that no ``REVOKED`` record names. A save
    creates marker `next_index` only when no commit is current, so at most one is; a
    marker created after its revocation (a save that listed before a commit and its
    deletion both happened) is void from the start.
    """

    step: int
    commits: frozenset[int] = frozenset()
    revoked: frozenset[int] = frozenset()

    @property
    def current(self) -> int | None:
        live = self.commits - self.revoked
        return max(live) if live else None

    @property
    def next_index(self) -> int:
        return max(self.commits | self.revoked, default=-1) + 1


async def step_records(backend: Backend, step: int) -> StepRecords:
    """``step``'s markers and revocations: one listing of its directory."""
    commits: set[int] = set()
    revoked: set[int] = set()
    try:
        names = await backend.list_dir(layout.step_dir(step))
    except NotFoundError:  # the root itself is missing (a bucket): nothing is committed
        names = []
    for name in names:
        record = layout.parse_step_record(name)
        if record is not None:
            (commits if record[0] == layout.COMMIT_MARKER else revoked).add(record[1])
    return StepRecords(step, frozenset(commits), frozenset(revoked))


async def ensure_uncommitted(backend: Backend, step: int) -> None:
    """Raise `AlreadyExistsError` if ``step`` is committed (a fast, early refusal); a step
    directory leading out of the root is `InvalidKeyError`."""
    if (await step_records(backend, step)).current is not None:
        raise AlreadyExistsError(
            f"checkpoint step {step} is already committed",
            backend=backend.url,
            key=layout.commit_key(step),
        )


async def create_marker(backend: Backend, step: int, data: bytes) -> int:
    """Create ``step``'s next commit marker holding ``data``; returns its index.

    `AlreadyExistsError` if a commit of the step is current, or another writer created
    that marker first, or a deletion revoked it before it was created (this writer listed
    the step before another commit and its deletion both happened): never two current
    commits, and never a marker a stale deletion may take for its own.
    """
    records = await step_records(backend, step)
    index = records.next_index
    key = layout.commit_key(step, index)
    if records.current is None:
        try:
            await backend.create(key, data)
        except AlreadyExistsError:
            pass
        else:
            if not await backend.exists(layout.revoked_key(step, index)):
                return index
    raise AlreadyExistsError(
        f"step {step} was committed by another writer first", backend=backend.url, key=key
    )


async def revoke(backend: Backend, step: int, index: int, attempt: str | None) -> None:
    """Delete ``step``'s ``index``-th commit (naming ``attempt``, as the caller read it):
    its ``REVOKED`` record (create-if-absent, so a second deletion of the same commit is a
    no-op), then the marker itself. A commit made since (a higher index) is untouched."""
    record = json.dumps({"attempt": attempt, "time": time.time()}).encode()
    try:
        await backend.create(layout.revoked_key(step, index), record)
    except AlreadyExistsError:
        pass
    await backend.delete(layout.commit_key(step, index))


async def commit(backend: Backend, manifest: Manifest, fate: Fate) -> Marker:
    """Write the attempt's manifest, then create the marker: the step is committed after this.

    ``fate`` is the caller's won `claim` of the attempt for its commit. Raises
    `AlreadyExistsError` if another attempt committed the step first; this attempt is
    then left as it is (garbage for `gc`), and the winner is untouched.
    """
    if manifest.attempt is None:
        raise ValueError("only attempt-scoped (format version 2) checkpoints are written")
    where = AttemptDir(manifest.step, manifest.attempt)
    if fate.kind != COMMIT:
        raise ValueError(f"commit needs the attempt claimed for its commit, not {fate.kind}")

    def encoded() -> bytes:
        data = manifest.to_bytes()
        # What a reader would refuse is never committed (a hand-edited part record, say).
        Manifest.from_bytes(data, where=f"{backend.url}/{where.manifest} (not written)")
        return data

    async def written() -> bytes | None:
        # Milliseconds per few hundred leaves: on a worker thread, never holding the loop.
        data = await off_loop(encoded, THREAD_BYTES)
        await backend.write(where.manifest, data)
        if manifest.base is not None:  # after the manifest is visible: docs/incremental.md
            await check_base(backend, manifest.base)
        return data

    # Every directory the attempt created is made durable before the marker, while the
    # manifest is encoded, written (its own directory with it) and the base checked.
    try:
        data, _ = await gather_first_error([written(), supports.sync_dirs(backend, where.root)])
    except BaseStepGoneError:
        await _give_up(backend, where, fate)
        raise
    assert data is not None
    fate.check_fresh(where)
    manifest_digest = digest(data)
    marker = Marker(
        step=manifest.step,
        attempt=manifest.attempt,
        manifest_digest=manifest_digest,
        token=secrets.token_hex(16),
        time=time.time(),
        format_version=manifest.format_version,
    )
    try:
        index = await create_marker(backend, manifest.step, marker.to_bytes())
    except AlreadyExistsError as exc:
        raise AlreadyExistsError(
            f"{exc.message}; attempt {manifest.attempt} was not committed",
            backend=backend.url,
            key=exc.key,
        ) from exc
    RECENT.add(manifest, manifest_digest, len(data))
    return dataclasses.replace(marker, index=index)


async def check_base(backend: Backend, base: Reference) -> None:
    """`BaseStepGoneError` unless the base an incremental save names is still committed:
    no ``DELETED`` record in its attempt (read first), then its step's marker still naming
    it. Called after the referencing manifest is written and before its marker: a
    deletion that had not begun by the first read sees that manifest when it looks for
    references, so it keeps what the manifest references (docs/incremental.md)."""
    where = base.dir
    if await backend.exists(where.deleted):
        raise BaseStepGoneError(
            f"base step {where.step} was deleted while this save referenced it; not committed",
            backend=backend.url,
            key=where.deleted,
        )
    marker = await read_marker(backend, where.step)
    if marker is None or marker.attempt != where.attempt:
        raise BaseStepGoneError(
            f"base step {where.step} (attempt {where.attempt}) is no longer committed; "
            "this save was not committed",
            backend=backend.url,
            key=layout.commit_key(where.step),
        )


async def _give_up(backend: Backend, where: AttemptDir, fate: Fate) -> None:
    """An incremental save whose base went: abandon its own attempt (a dead attempt's
    references keep nothing alive) and remove what it wrote, its tombstone left for gc."""
    try:
        await claim(backend, where, ABANDON, fate.owner)
        await clear_attempt(backend, where, keep_fate=True)
    except Exception:  # the base's error is the one to raise; gc removes the rest
        pass


# ---- readers ----


async def committed_steps(backend: Backend) -> list[int]:
    """Steps with a current commit marker, ascending (the markers are not opened)."""
    candidates = sorted(
        s for s in (layout.parse_step(n) for n in await backend.list_dir()) if s is not None
    )
    flags = await asyncio.gather(*(is_committed(backend, s) for s in candidates))
    return [s for s, ok in zip(candidates, flags, strict=True) if ok]


async def is_committed(backend: Backend, step: int) -> bool:
    """Whether ``step`` has a current commit marker (not opened)."""
    try:
        return (await step_records(backend, step)).current is not None
    except InvalidKeyError:  # the step's directory leads out of the root (a symlink): listed,
        return True  # so that reading it says so (`read_marker`) rather than hiding it


async def read_marker_bytes(backend: Backend, step: int) -> tuple[int, bytes] | None:
    """The index and content of ``step``'s current marker, or None if it is not committed
    (a marker deleted between the listing and its read counts as deleted)."""
    try:
        index = (await step_records(backend, step)).current
        if index is None:
            return None
        return index, await backend.read(layout.commit_key(step, index))
    except NotFoundError:
        return None
    except InvalidKeyError as exc:
        raise CorruptCheckpointError(f"step {step} cannot be read: {exc}") from exc


async def same_commit(a: Backend, b: Backend, step: int) -> bool:
    """Whether ``a`` and ``b`` both have ``step`` committed by byte-identical markers (a
    promoted copy and its original)."""
    x, y = await asyncio.gather(read_marker_bytes(a, step), read_marker_bytes(b, step))
    return x is not None and y is not None and x[1] == y[1]


async def read_marker(backend: Backend, step: int) -> Marker | None:
    """The parsed current marker of ``step``, or None if the step is not committed."""
    found = await read_marker_and_bytes(backend, step)
    return None if found is None else found[1]


async def read_marker_and_bytes(backend: Backend, step: int) -> tuple[bytes, Marker] | None:
    """`read_marker`, with the marker's bytes as stored (what a promotion copies)."""
    found = await read_marker_bytes(backend, step)
    if found is None:
        return None
    index, data = found
    key = layout.commit_key(step, index)
    return data, Marker.from_bytes(data, step=step, where=f"{backend.url}/{key}", index=index)


async def load_committed(backend: Backend, step: int, *, recent: bool = False) -> Manifest:
    """The verified manifest of committed ``step``.

    Raises `CheckpointNotFoundError` if the step is not committed and
    `CorruptCheckpointError` if the marker, the manifest or their agreement fails.
    ``recent`` (an incremental save reading its base): a manifest this process committed
    lately (`RecentCommits`) is taken as it is when the marker names its attempt and its
    bytes' digest, not read and parsed again; restores and verify always read what is stored.
    """
    marker = await read_marker(backend, step)
    if marker is None:
        raise CheckpointNotFoundError(
            f"step {step} is not committed; {await _what_is_there(backend)}",
            backend=backend.url,
            key=layout.commit_key(step),
        )
    known = RECENT.get(step, marker.attempt, marker.manifest_digest) if recent else None
    return known if known is not None else await load_manifest(backend, marker)


class RecentCommits:
    """The last few manifests this process committed, by step, attempt and digest.

    While a step's marker names the attempt and the digest of the manifest kept here, the
    stored manifest is this one (the marker's digest is checked on every read; a manifest
    rewritten since, with a marker signed again, has another digest), on whichever backend
    or tier it was copied to. The next incremental save's base is nearly always the step
    saved last: this spares it a read and a parse of a manifest that records every chunk's
    digest (docs/benchmarks.md). Several are kept, so that saves into a few roots by one
    process (several managers, a benchmark's side-by-side saves) each find their own:
    at most ``size`` of them, and of at most ``budget`` encoded bytes in all (the last one
    always, whatever its size).
    """

    def __init__(self, size: int = 8, budget: int = 32 << 20) -> None:
        self.size, self.budget = size, budget
        self._kept: collections.OrderedDict[tuple[int, str, str], tuple[Manifest, int]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # managers save on threads of their own

    def add(self, manifest: Manifest, manifest_digest: str, nbytes: int = 0) -> None:
        """Keep ``manifest`` (``nbytes`` encoded), dropping the oldest beyond the limits."""
        if manifest.attempt is None:
            return
        key = (manifest.step, manifest.attempt, manifest_digest)
        with self._lock:
            self._kept[key] = (manifest, nbytes)
            self._kept.move_to_end(key)
            total = sum(n for _, n in self._kept.values())
            while len(self._kept) > self.size or (total > self.budget and len(self._kept) > 1):
                total -= self._kept.popitem(last=False)[1][1]

    def get(self, step: int, attempt: str | None, manifest_digest: str | None) -> Manifest | None:
        if attempt is None or manifest_digest is None:
            return None
        with self._lock:
            found = self._kept.get((step, attempt, manifest_digest))
        return None if found is None else found[0]


#: This process's `RecentCommits` (filled by `commit`).
RECENT = RecentCommits()


async def _what_is_there(backend: Backend) -> str:
    """For an error about a step that is not there: the committed steps (the last few),
    or that there are none, or that the root itself does not exist (a mistyped path)."""
    steps = await committed_steps(backend)
    if steps:
        shown = ", ".join(map(str, steps[-SHOWN_STEPS:]))
        more = f" (the last {SHOWN_STEPS} of {len(steps)})" if len(steps) > SHOWN_STEPS else ""
        return f"committed steps: {shown}{more}"
    try:
        await backend.check_root()
    except NotFoundError as exc:
        return exc.message
    return "no step is committed there"


#: How many committed steps an error about a missing one names.
SHOWN_STEPS = 10


async def load_manifest(backend: Backend, marker: Marker) -> Manifest:
    """The manifest ``marker`` names, checked against it."""
    key = marker.where.manifest
    where = f"{backend.url}/{key}"
    try:
        data = await backend.read(key)
    except NotFoundError as exc:
        raise CorruptCheckpointError(
            f"step {marker.step} is committed but its manifest {where} is missing"
        ) from exc
    if marker.manifest_digest is not None and digest(data) != marker.manifest_digest:
        raise CorruptCheckpointError(
            f"manifest {where} does not match the digest in its commit marker "
            "(changed after the commit)"
        )
    # Parsing costs about as much as copying 16 times the bytes: a large manifest's parse
    # runs on a worker thread rather than hold the event loop.
    manifest = await off_loop(lambda: Manifest.from_bytes(data, where=where), 16 * len(data))
    if manifest.step != marker.step or manifest.attempt != marker.attempt:
        raise CorruptCheckpointError(
            f"manifest {where} describes step {manifest.step} attempt {manifest.attempt}, "
            f"not step {marker.step} attempt {marker.attempt}"
        )
    return manifest


async def resolve_step(backend: Backend, step: int | None) -> int:
    """``step`` itself, checked, or the latest committed step when None."""
    if step is not None:
        return layout.check_step(step)
    steps = await committed_steps(backend)
    if not steps:
        raise CheckpointNotFoundError(
            f"no committed checkpoint: {await _what_is_there(backend)}", backend=backend.url
        )
    return steps[-1]


async def latest_manifest(backend: Backend, step: int | None = None) -> Manifest:
    """The verified manifest of ``step``, or of the latest committed step when None."""
    return await load_committed(backend, await resolve_step(backend, step))
