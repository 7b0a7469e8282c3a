"""A step's commit markers: what one holds, which one is current, how one is created and
revoked.

The commit is one create-if-absent of ``<step>/COMMITTED`` (``COMMITTED.<n>`` for the n-th
commit of a step deleted and saved again), naming the attempt and carrying the sha256 of that
attempt's ``manifest.json``: the first writer to create it wins, every other gets
`AlreadyExistsError`. Markers are superseded, never taken back: a deletion creates
``<step>/REVOKED.<n>`` for the commit it read, and only then removes that marker; a later
save of the step creates ``COMMITTED.<n+1>``. No key a deleter removes can name a newer
commit, so a stale deletion never removes a re-saved step. `StepRecords` says which commit
is current.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field

from ckptstore.backends.base import Backend
from ckptstore.errors import (
    AlreadyExistsError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.format import layout
from ckptstore.format.layout import AttemptDir


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


async def create_marker(
    backend: Backend, step: int, data: bytes, records: StepRecords | None = None
) -> int:
    """Create ``step``'s next commit marker holding ``data``; returns its index.

    `AlreadyExistsError` if a commit of the step is current, or another writer created
    that marker first, or a deletion revoked it before it was created (this writer listed
    the step before another commit and its deletion both happened): never two current
    commits, and never a marker a stale deletion may take for its own.

    ``records``: the step's listing (`step_records`) if the writer took it already, since
    it claimed its attempt (so that no revocation it missed has expired: `fates.CLAIM_TTL`);
    None: listed now. A listing taken earlier is only staler, which the above covers.
    """
    if records is None:
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
