"""An attempt's fate: commit, abandon or collect, decided once by the first actor to claim it.

Several actors may share one attempt (a partial-save session and its zombie, ``abandon``,
``gc``). Whoever would commit, abandon or collect an attempt first claims its fate: one
create-if-absent of ``<attempt>/FATE``. Exactly one actor wins; every other gets
`FencedError` before its first write (a committer claims before it merges, so a loser never
rebuilds a store someone committed). Once decided, a fate never changes: only the winner
writes or deletes below the attempt, and after the commit only ``delete_step``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field

from ckptstore.backends.base import Backend
from ckptstore.errors import (
    AlreadyExistsError,
    CorruptCheckpointError,
    FencedError,
    NotFoundError,
)
from ckptstore.format.layout import AttemptDir

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
