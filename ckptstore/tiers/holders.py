"""Promoting an incremental step: the attempts it references are made durable first.

A step saved with ``base=`` (docs/incremental.md) reads some leaves from other attempts,
its *holders* (the manifest's ``references``). Its durable copy reads them at the same
``<step>/<attempt>/`` paths on the durable tier (an attempt directory is relocatable), and
must keep finding them there until it is deleted. Before the step's own objects are copied,
each holder is made durable once (`make_durable`):

1. the base step, when it is committed on the fast tier with the attempt the manifest
   names, is promoted first (its own promotion does all this for its holders);
2. a holder that a committed durable step *guards* (the holder's own step, committed with
   that attempt, or a step that references it) is there already: nothing is copied;
3. a holder whose own step is committed on the fast tier is promoted as that step;
4. otherwise (its step was deleted; the fast tier keeps its bytes because the step
   references them) its objects are copied without a marker, under a commit claim of its
   fate on the durable tier, made before the first byte. The claim's owner is derived from
   the holder, so every promotion that needs it is the same owner and resumes the copy;
   and `gc` never collects an attempt claimed for its commit until `fates.CLAIM_TTL`.
   Killed midway, the copy is garbage of the durable tier, collected after that.

Objects already on the durable tier with the right size are not copied again, so a
holder's bytes cross the network once, whatever number of steps reference it.

After the step's own objects landed (its manifest, under its own commit claim, is then a
save in flight to every `gc` and `delete_step` of the durable tier) and right before its
marker, `Holders.check` re-checks that each holder is still protected, as an incremental
save re-checks its base (`protocol.check_base`; the argument is docs/incremental.md's):

- by a guard: its attempt has no ``DELETED`` record, and its marker still names it. A
  deletion of the guard that had not begun then finds the step's manifest and keeps the
  guard's attempt, and a `gc` that reads the guard's marker after its deletion lists the
  saves in flight later still, so it finds the manifest and keeps the holder;
- by this promotion's claim: still ours, fresh (`Fate.check_fresh`), and no ``DELETED``
  record on the holder (a `gc` collects a holder without a claim only once its scan found
  it dead; it was not, when this check read it after the step's manifest landed).

Otherwise `FencedError` and nothing is committed (a retry plans again).

A holder that was deleted on the durable tier (it has a ``DELETED`` record there) and
that no committed durable step guards is never named again: a `gc` collects a dead
attempt's data without a claim, so it may be removing it at that very moment. Promotion
then fails typed until `gc` has freed it (and, a day later, its records). This happens
only when a deletion on the durable tier raced a promotion (a deletion that found no
reference frees the attempt at once, records and all).

After the marker
(`Holders.release`), each holder copied under a claim gets a ``DELETED`` record: it is a
deleted step's bytes, kept while a committed step references them and freed by the first
`gc` after the last one goes, exactly as on the fast tier.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.checkpoint.cleanup import DELETE, mark_deleted
from ckptstore.errors import CorruptCheckpointError, FencedError
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest, Reference
from ckptstore.protocol import (
    COMMIT,
    Attempt,
    Fate,
    check_base,
    committed_steps,
    load_manifest,
    read_marker,
)

Holder = tuple[int, str]  # (step, attempt)
#: Promotes one committed step of the fast tier (`promote.promote_step`, passed in).
PromoteStep = Callable[[int], Awaitable[Any]]
#: Copies objects below a root to the durable tier; returns (objects copied, bytes copied).
CopyObjects = Callable[[list[ObjectInfo], str], Awaitable[tuple[int, int]]]


@dataclass
class Holders:
    """What `make_durable` did for one step's holders, and what protects each."""

    guards: dict[Holder, Holder] = field(default_factory=dict)  # holder -> committed guard
    claimed: dict[Holder, Fate] = field(default_factory=dict)  # holder -> our commit claim
    promoted: list[Any] = field(default_factory=list)  # `Promotion`s of steps promoted now
    objects: int = 0  # objects of claimed holders copied now
    bytes: int = 0  # their bytes

    def add(self, promotion: Any) -> None:
        """A step promoted first (one the durable tier had already is not listed)."""
        if not promotion.already:
            self.promoted.append(promotion)

    async def check(self, durable: Backend) -> None:
        """Right before the step's marker: every holder is still protected (module
        docstring); `FencedError` or `CheckpointNotFoundError` otherwise."""
        for holder in sorted(set(self.guards) | set(self.claimed)):
            fate = self.claimed.get(holder)
            where = layout.AttemptDir(*holder)
            if fate is not None and await _still_ours(durable, where, fate):
                continue
            guard = self.guards.get(holder) or await find_guard(durable, holder)
            if guard is None:
                raise FencedError(
                    f"the durable copy of attempt {where.root}, which this step references, "
                    "is no longer protected (deleted meanwhile); not committed: promote again",
                    backend=durable.url,
                    key=where.root,
                )
            await check_base(durable, Reference(*guard))

    async def release(self, durable: Backend) -> None:
        """After the step's marker: holders copied under a claim are a deleted step's
        bytes, kept by the references alone from now on (module docstring)."""
        for holder in sorted(self.claimed):
            await mark_deleted(durable, layout.AttemptDir(*holder), DELETE)


async def make_durable(
    fast: Backend,
    durable: Backend,
    manifest: Manifest,
    promote_step: PromoteStep,
    copy: CopyObjects,
) -> Holders:
    """Make every attempt ``manifest`` references durable (module docstring, 1-4)."""
    out = Holders()
    base = manifest.base
    if base is not None:  # 1: the base step first, if the fast tier still has it
        if await _promotable(fast, durable, base.step, base.attempt):
            out.add(await promote_step(base.step))
    for ref in manifest.references:
        holder = (ref.step, ref.attempt)
        guard = await find_guard(durable, holder, base)
        if guard is None:  # 3: its own step, if the fast tier still has it committed
            if await _promotable(fast, durable, *holder):
                out.add(await promote_step(holder[0]))
                guard = holder
        if guard is not None:
            out.guards[holder] = guard
            continue
        where = layout.AttemptDir(*holder)  # 4: copied under our claim
        if await durable.exists(where.deleted):  # dead there: a gc may be freeing it
            raise FencedError(
                f"attempt {where.root}, which step {manifest.step} references, was freed on "
                f"the durable tier {durable.url} (no committed step there references it "
                "any more; a gc may be removing it); not promoted. Once gc freed it, and its "
                "records a day later, promote again",
                backend=durable.url,
                key=where.deleted,
            )
        out.claimed[holder] = await _claim(durable, holder)
        records = {f"{where.root}/{name}" for name in layout.TOMBSTONES}
        objects = [info async for info in fast.list(where.root) if info.key not in records]
        if not any(o.key == where.manifest for o in objects):
            raise CorruptCheckpointError(
                f"attempt {where.root}, which step {manifest.step} references, is missing "
                f"on the fast tier {fast.url}; not promoted"
            )
        copied, nbytes = await copy(objects, where.root)
        out.objects += copied
        out.bytes += nbytes
    return out


async def find_guard(
    durable: Backend, holder: Holder, base: Reference | None = None
) -> Holder | None:
    """A step committed on ``durable`` that protects ``holder``: the holder's own step
    (committed with that attempt), else the base ``base`` names, else any committed step
    whose manifest references it; None if there is none."""
    marker = await read_marker(durable, holder[0])
    if marker is not None and marker.attempt == holder[1]:
        return holder
    candidates = await committed_steps(durable)
    if base is not None and base.step in candidates:  # the likeliest: try it first
        candidates.remove(base.step)
        candidates.insert(0, base.step)
    want = Reference(*holder)
    for step in candidates:
        marker = await read_marker(durable, step)
        if marker is None or marker.attempt is None:
            continue
        try:
            manifest = await load_manifest(durable, marker)
        except CorruptCheckpointError:
            continue  # a damaged step guards nothing
        if want in manifest.references:
            return (step, marker.attempt)
    return None


async def _promotable(fast: Backend, durable: Backend, step: int, attempt: str) -> bool:
    """Whether ``step`` is committed on the fast tier with ``attempt`` and can be promoted
    as a step: not deleted on the durable tier after an earlier promotion (a dead attempt
    there is never named by a marker again: `promote.refuse_dead`)."""
    marker = await read_marker(fast, step)
    if marker is None or marker.attempt != attempt:
        return False
    return not await durable.exists(layout.AttemptDir(step, attempt).deleted)


def _owner(holder: Holder) -> str:
    """The fate owner of every promotion copying ``holder`` (one owner: each resumes)."""
    return "promote-held-" + hashlib.sha256(f"{holder[0]}/{holder[1]}".encode()).hexdigest()[:32]


async def _claim(durable: Backend, holder: Holder) -> Fate:
    where = layout.AttemptDir(*holder)
    try:
        return await Attempt(durable, where, _owner(holder)).claim(COMMIT)
    except FencedError as exc:
        raise FencedError(
            f"attempt {where.root}, which the step being promoted references, has another "
            f"fate on the durable tier {durable.url} (its step was promoted, then deleted "
            f"there?): {exc.message}. Not promoted; `gc` frees it (a day after its fate was "
            "decided), then promote again",
            backend=durable.url,
            key=where.fate,
        ) from exc


async def _still_ours(durable: Backend, where: layout.AttemptDir, fate: Fate) -> bool:
    """Our claim on a holder still protects it: ours, fresh, and no ``DELETED`` record."""
    fate.check_fresh(where)
    try:
        current = await Attempt(durable, where).fate()
    except CorruptCheckpointError:
        return False
    if current is None or current.owner != fate.owner or current.kind != COMMIT:
        return False
    return not await durable.exists(where.deleted)
