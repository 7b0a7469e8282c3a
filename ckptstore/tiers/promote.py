"""Tiered storage: saves land on a fast tier (local NVMe); committed steps are promoted,
unchanged, to a durable tier (S3, GCS); restores read the nearest tier that holds a good copy.

A step's attempt directory is relocatable (the merged OCDBT store references its data
files by relative path), so promotion copies the committed attempt's objects as they are
and then creates the durable tier's ``COMMITTED`` with the very bytes of the fast tier's
marker, last: the durable tier never lists a step that is not fully there. Objects
already on the durable tier with the right size are not copied again, so an interrupted
promotion resumes where it stopped (each object write is atomic on every backend).

An incremental step (saved with ``base=``) first makes durable the attempts it reads
from, once each, and commits only while they stay protected (`ckptstore.tiers.holders`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.checkpoint.cleanup import deleted_by_user, remove_step, trim_step
from ckptstore.checkpoint.stagedrecord import read_staged, staged_steps
from ckptstore.checkpoint.verify import verify_step
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FencedError,
    StorageError,
)
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import (
    COMMIT,
    Attempt,
    Fate,
    Marker,
    committed_steps,
    create_marker,
    digest,
    load_manifest,
    read_marker_and_bytes,
    read_marker_bytes,
    same_commit,
)
from ckptstore.runtime import distributed
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.futures import gather_first_error
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.holders import Holders, make_durable
from ckptstore.tiers.hostlocal import (
    drop_staged,
    fast_is_shared,
    merge_on_durable,
    promoted_part,
    staged_everywhere,
)
from ckptstore.tiers.target import AnyTarget, Tiered, as_tiered

log = logging.getLogger("ckptstore")

#: Bytes of objects read from the fast tier and not yet written to the durable one.
PROMOTE_BYTES_IN_FLIGHT = 256 << 20


@dataclass
class Promotion:
    """What promoting one step did."""

    step: int
    attempt: str | None
    objects: int = 0  # objects of the committed attempt
    copied: int = 0  # objects copied now (the rest were already on the durable tier)
    bytes: int = 0  # bytes copied now
    seconds: float = 0.0
    already: bool = False  # the durable tier had the step committed already
    #: An incremental step (docs/incremental.md): steps promoted first because it reads
    #: from them (its base, a holder's own step), and the objects and bytes copied of
    #: attempts it reads from whose step is gone (`ckptstore.tiers.holders`).
    bases: list[Promotion] = field(default_factory=list)
    held_objects: int = 0
    held_bytes: int = 0


async def promote(
    tiered: AnyTarget | None,
    step: int | None = None,
    *,
    max_bytes_in_flight: int = PROMOTE_BYTES_IN_FLIGHT,
    progress: Callable[[int, int], None] | None = None,
    timeout: float = distributed.DEFAULT_TIMEOUT,
) -> list[Promotion]:
    """Promote ``step`` (default: every committed step the durable tier lacks), oldest first.

    ``progress(bytes_done, bytes_total)`` is called as objects land. Then, with
    ``keep_fast``, promoted steps beyond the latest ``keep_fast`` leave the fast tier.
    In a multi-process job every process calls it: with one shared fast tier process 0
    promotes (the others get ``[]``); with host-local fast tiers (see
    `ckptstore.tiers.hostlocal`) every process uploads its part of each staged step
    and process 0 merges and commits on the durable tier. ``tiered`` is a `Tiered`, a
    profile with a ``[tiers]`` table, or None for ``$CKPTSTORE_PROFILE``.
    """
    tiers = as_tiered(tiered)
    if tiers is None:
        raise ConfigError(f"promote needs two tiers (a Tiered or a [tiers] profile): {tiered!r}")
    async with tiers.opened() as (fast, durable):
        if distributed.process_count() > 1:
            handoff = Handoff("promote", timeout)
            if not await fast_is_shared(fast, handoff):
                return await promote_staged(
                    fast, durable, handoff, step, tiers.keep_fast, max_bytes_in_flight, progress
                )

            async def here() -> list[Promotion]:
                return await _promote(tiers, fast, durable, step, max_bytes_in_flight, progress)

            return await handoff.primary(here) or []
        return await _promote(tiers, fast, durable, step, max_bytes_in_flight, progress)


async def _promote(
    tiered: Tiered,
    fast: Backend,
    durable: Backend,
    step: int | None,
    max_bytes_in_flight: int,
    progress: Callable[[int, int], None] | None,
) -> list[Promotion]:
    steps = await unpromoted(fast, durable) if step is None else [layout.check_step(step)]
    done = [await promote_step(fast, durable, s, max_bytes_in_flight, progress) for s in steps]
    if tiered.keep_fast is not None:
        await trim_fast(fast, durable, tiered.keep_fast)
    return done


async def unpromoted(fast: Backend, durable: Backend) -> list[int]:
    """Steps committed on ``fast`` whose durable marker is missing or differs, ascending
    (what ``promote(tiered)`` promotes; a differing marker is refused there)."""
    on_durable = set(await committed_steps(durable))
    return [
        s
        for s in await committed_steps(fast)
        if s not in on_durable or not await same_commit(fast, durable, s)
    ]


async def promote_staged(
    fast: Backend,
    durable: Backend,
    handoff: Handoff,
    step: int | None,
    keep_fast: int | None,
    max_bytes_in_flight: int = PROMOTE_BYTES_IN_FLIGHT,
    progress: Callable[[int, int], None] | None = None,
) -> list[Promotion]:
    """Host-local fast tiers (every process calls this): each process uploads its part of
    each staged step (default: every one all processes staged and the durable tier lacks),
    then process 0 merges on the durable tier and commits there, last."""
    if step is None:  # a step staged by some processes only is a save that never finished
        steps = await staged_everywhere(fast, handoff)
    else:
        steps = [layout.check_step(step)]

    async def plan() -> str:
        on_durable = set(await committed_steps(durable))
        todo = []
        for s in steps:
            mine = await read_staged(fast, s)
            if mine is None:
                raise CheckpointNotFoundError(
                    f"step {s} is not staged on process 0's fast tier", backend=fast.url
                )
            if step is not None or s not in on_durable:
                todo.append({"step": s, "attempt": mine.attempt})
        return json.dumps(todo)

    done = [
        await _promote_part(
            fast, durable, handoff, int(e["step"]), str(e["attempt"]), max_bytes_in_flight, progress
        )
        for e in json.loads(await handoff.agree(plan))
    ]
    if keep_fast is not None:  # this host's parts of durable steps beyond the latest keep_fast
        on_durable = set(await committed_steps(durable))
        promoted = [s for s in await staged_steps(fast) if s in on_durable]
        for s in promoted[:-keep_fast]:
            await drop_staged(fast, s)
    return done


async def _promote_part(
    fast: Backend,
    durable: Backend,
    handoff: Handoff,
    step: int,
    attempt: str,
    max_bytes_in_flight: int,
    progress: Callable[[int, int], None] | None,
) -> Promotion:
    """One staged step: this process uploads its part; process 0 merges and commits."""
    result = Promotion(step=step, attempt=attempt)
    start = time.perf_counter()

    async def upload() -> dict[str, Any]:
        mine = await read_staged(fast, step)
        if mine is None or mine.attempt != attempt:
            raise CorruptCheckpointError(
                f"process {handoff.me}: step {step} attempt {attempt} is not staged on {fast.url}"
            )
        root = layout.AttemptDir(step, attempt).root
        objects = [i async for i in fast.list(root) if promoted_part(i.key, root, handoff.me)]
        await copy_objects(fast, durable, objects, root, result, max_bytes_in_flight, progress)
        return {"copied": result.copied}

    async def commit_durable() -> None:
        await handoff.reports()  # raises if a process failed: every part is there otherwise
        mine = await read_staged(fast, step)
        assert mine is not None
        await merge_on_durable(durable, mine)

    await handoff.everyone(upload)
    await handoff.primary(commit_durable)
    result.seconds = time.perf_counter() - start
    return result


async def promote_step(
    fast: Backend,
    durable: Backend,
    step: int,
    max_bytes_in_flight: int = PROMOTE_BYTES_IN_FLIGHT,
    progress: Callable[[int, int], None] | None = None,
    visiting: frozenset[tuple[int, str | None]] = frozenset(),
) -> Promotion:
    """Copy committed ``step``'s attempt from ``fast`` to ``durable``; its marker last.

    ``visiting``: the incremental steps whose promotion is promoting this one first (a
    base or a holder, `holders.make_durable`); meeting one again is a reference cycle,
    `CorruptCheckpointError`, as is a chain deeper than `MAX_CHAIN`.

    The durable attempt's fate is claimed for this commit before anything is copied (the
    owner is named after the marker, so a resumed or concurrent promotion of the same
    step is the same owner), so a `gc` of the durable tier never collects it midway.
    A `delete_step` of the step on tiers that ran meanwhile is honoured: the marker is
    taken back and `FencedError` raised (the ``DELETED`` record it leaves, checked after
    the marker is created)."""
    start = time.perf_counter()
    marker_bytes, marker = await _fast_marker(fast, step)
    manifest = await load_manifest(fast, marker)
    visiting = _visit(visiting, step, marker.attempt)
    result = Promotion(step=step, attempt=marker.attempt)
    if await _same_marker(durable, step, marker_bytes):
        result.already = True
        return result
    upload = _Upload(fast, durable, marker, marker_bytes, manifest, result, max_bytes_in_flight)
    # Only a verified copy is promoted (of an incremental step, its own leaves here; those
    # it references in a holder are checked before that holder is copied, `copy_held`, or
    # by the promotion of their own step). The check reads the fast copy while the upload
    # runs, and the marker waits for both: a damaged copy fails the promotion before
    # anything is committed, and what was uploaded is an uncommitted attempt, as after a
    # promotion killed midway.
    checked = [marker.where.root] if manifest.references else None
    await gather_first_error(
        [_check_fast_copy(fast, step, checked), upload.run(progress, visiting)]
    )
    await upload.commit()
    result.seconds = time.perf_counter() - start
    return result


async def _fast_marker(fast: Backend, step: int) -> tuple[bytes, Marker]:
    """Committed ``step``'s marker on the fast tier: its bytes, parsed."""
    found = await read_marker_and_bytes(fast, step)
    if found is None:
        raise CheckpointNotFoundError(
            f"step {step} is not committed on the fast tier",
            backend=fast.url,
            key=layout.commit_key(step),
        )
    return found


@dataclass
class _Upload:
    """One step's promotion after its checks: the copy of its attempt (and, of an
    incremental step, first what it references), then the marker (`commit`)."""

    fast: Backend
    durable: Backend
    marker: Marker
    marker_bytes: bytes
    manifest: Manifest
    result: Promotion
    max_bytes_in_flight: int
    fate: Fate | None = None  # the durable attempt's fate, claimed for this commit
    held: Holders | None = None  # what the step references, made durable first

    async def run(
        self,
        progress: Callable[[int, int], None] | None,
        visiting: frozenset[tuple[int, str | None]],
    ) -> None:
        """Claim the durable attempt's fate, make what it references durable, copy it."""
        marker, result = self.marker, self.result
        if marker.attempt is not None:
            owner = "promote-" + digest(self.marker_bytes).removeprefix("sha256:")[:32]
            self.fate = await Attempt(self.durable, marker.where, owner).claim(COMMIT)
            await refuse_dead(self.durable, marker.where)
        if self.manifest.references:  # an incremental step: the attempts it reads from, first
            self.held = await self._references_first(progress, visiting)
            result.bases = self.held.promoted
            result.held_objects, result.held_bytes = self.held.objects, self.held.bytes
        objects = await attempt_objects(self.fast, marker)
        await copy_objects(
            self.fast,
            self.durable,
            objects,
            marker.where.root,
            result,
            self.max_bytes_in_flight,
            progress,
        )
        await load_manifest(self.durable, marker)  # the durable copy's manifest checks out

    async def _references_first(
        self,
        progress: Callable[[int, int], None] | None,
        visiting: frozenset[tuple[int, str | None]],
    ) -> Holders:
        """Make durable what an incremental step references: each holder's step promoted
        first, or the held objects copied under this step (`holders.make_durable`)."""
        fast, durable, step = self.fast, self.durable, self.result.step

        async def promote_first(at: int) -> Promotion:
            return await promote_step(
                fast, durable, at, self.max_bytes_in_flight, progress, visiting
            )

        async def copy_held(objects: list[ObjectInfo], root: str) -> tuple[int, int]:
            await _check_fast_copy(fast, step, [root])  # the leaves this step reads there
            scratch = Promotion(step=step, attempt=self.marker.attempt)
            await copy_objects(fast, durable, objects, root, scratch, self.max_bytes_in_flight)
            return scratch.copied, scratch.bytes

        return await make_durable(fast, durable, self.manifest, promote_first, copy_held)

    async def commit(self) -> None:
        """The durable marker, once the fate is still ours and what the step references
        is still kept; taken back (`FencedError`) if the step was deleted on the fast tier
        meanwhile."""
        durable, marker, step = self.durable, self.marker, self.result.step
        if self.fate is not None:
            self.fate.check_fresh(marker.where)
        if self.held is not None:  # after its manifest landed: what it references is kept
            await self.held.check(durable)
        try:
            await create_marker(durable, step, self.marker_bytes)
        except AlreadyExistsError:
            if not await _same_marker(durable, step, self.marker_bytes):
                raise  # the durable tier committed another attempt of this step
        if self.held is not None:
            await self.held.release(durable)
        if marker.attempt is not None and await deleted_by_user(self.fast, marker.where):
            await _take_back(durable, step, self.marker_bytes)
            raise FencedError(
                f"step {step} was deleted while it was being promoted; not promoted",
                backend=durable.url,
                key=layout.commit_key(step, marker.index),
            )


async def refuse_dead(durable: Backend, where: layout.AttemptDir) -> None:
    """`FencedError` if the durable copy of the attempt was deleted there (its data kept
    only while other steps reference it): a `gc` may be freeing it right now (a dead
    attempt's data is collected without a claim), so no marker may name it again."""
    if await durable.exists(where.deleted):
        raise FencedError(
            f"step {where.step} was deleted on the durable tier (attempt {where.attempt} is "
            "kept there only for steps that reference it); not promoted again. Once no step "
            "references it, gc frees it (its records a day later); then promote again",
            backend=durable.url,
            key=where.deleted,
        )


async def _check_fast_copy(fast: Backend, step: int, held_by: list[str] | None = None) -> None:
    """Every chunk's crc32c and every pack's record, as `verify` checks them: a damaged fast
    copy is never made durable (nor, without a durable copy, trimmed by ``keep_fast``).
    ``held_by``: only the leaves those attempts hold (an incremental step's leaves held by
    an attempt durable already were checked when it was made durable; a full read again
    would cost each later step of a LoRA run a full step's read)."""
    report = await verify_step(fast, step, held_by=held_by)
    if report.problems:
        what, why = next(iter(report.problems.items()))
        raise CorruptCheckpointError(
            f"step {step} is damaged on the fast tier {fast.url} ({len(report.problems)} "
            f"problems; {what}: {why}); not promoted"
        )
    if report.unreadable:
        what, why = next(iter(report.unreadable.items()))
        raise StorageError(f"step {step} could not be read to verify it ({what}: {why})")


#: The most incremental steps one promotion promotes first, each for the one before (its
#: base or a holder's step): far beyond a real run's, which stay a step or two deep.
MAX_CHAIN = 64


def _visit(
    visiting: frozenset[tuple[int, str | None]], step: int, attempt: str | None
) -> frozenset[tuple[int, str | None]]:
    """``visiting`` with this step added; `CorruptCheckpointError` on a cycle or a chain
    too deep to be a real run's."""
    if (step, attempt) in visiting:
        chain = ", ".join(f"step {s}" for s, _ in sorted(visiting))
        raise CorruptCheckpointError(
            f"step {step} (attempt {attempt}) is in a reference cycle through its base or "
            f"holders ({chain}); not promoted"
        )
    if len(visiting) >= MAX_CHAIN:
        raise CorruptCheckpointError(
            f"step {step}'s bases and holders chain more than {MAX_CHAIN} steps deep; not promoted"
        )
    return visiting | {(step, attempt)}


async def _take_back(durable: Backend, step: int, marker_bytes: bytes) -> None:
    """Remove the durable copy a promotion just committed (its marker first), if the
    durable marker is still this one (`remove_step` revokes the very commit it checked)."""
    marker = Marker.from_bytes(marker_bytes, step=step, where=f"{durable.url} (promoted)")
    try:
        await remove_step(durable, step, attempt=marker.attempt)
    except CheckpointNotFoundError:
        return


async def copy_objects(
    fast: Backend,
    durable: Backend,
    objects: list[ObjectInfo],
    root: str,
    result: Promotion,
    max_bytes_in_flight: int = PROMOTE_BYTES_IN_FLIGHT,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Copy the ``objects`` (below ``root``) the durable tier lacks or holds with another
    size, at most ``max_bytes_in_flight`` read and not yet written; then check every one
    landed with its size. Counts go to ``result``."""
    have = {i.key: i.size async for i in durable.list(root)}
    todo = [o for o in objects if have.get(o.key) != o.size]
    result.objects, result.copied = len(objects), len(todo)
    total = sum(o.size for o in todo)
    budget = ByteBudget(max_bytes_in_flight)

    async def copy(info: ObjectInfo) -> None:
        async with budget.hold(info.size):
            data = await fast.read(info.key)
            if len(data) != info.size:
                raise CorruptCheckpointError(f"{fast.url}/{info.key} changed while promoting")
            await durable.write(info.key, data)
        result.bytes += info.size
        if progress is not None:
            progress(result.bytes, total)

    await gather_first_error(copy(o) for o in todo)  # a failure stops the other copies
    landed = {i.key: i.size async for i in durable.list(root)}
    missing = [o.key for o in objects if landed.get(o.key) != o.size]
    if missing:
        raise CorruptCheckpointError(
            f"promotion of step {result.step}: {len(missing)} objects missing or of the wrong "
            f"size on {durable.url} (first: {missing[0]})"
        )


async def _same_marker(durable: Backend, step: int, marker_bytes: bytes) -> bool:
    found = await read_marker_bytes(durable, step)
    if found is None:
        return False
    key = layout.commit_key(step, found[0])
    if found[1] != marker_bytes:
        raise AlreadyExistsError(
            "the durable tier has this step committed from another attempt",
            backend=durable.url,
            key=key,
        )
    return True


async def attempt_objects(fast: Backend, marker: Marker) -> list[ObjectInfo]:
    """The committed attempt's objects (a version-1 step: the step's non-attempt entries);
    not its fate or deletion records, which each tier keeps for itself."""
    if marker.attempt is not None:
        records = {f"{marker.where.root}/{name}" for name in layout.TOMBSTONES}
        return [info async for info in fast.list(marker.where.root) if info.key not in records]
    return [
        info
        async for info in fast.list(layout.step_dir(marker.step))
        if layout.parse_step_record(info.key.split("/")[1]) is None
        and not layout.is_attempt(info.key.split("/")[1])
    ]


async def trim_fast(fast: Backend, durable: Backend, keep: int) -> None:
    """Delete from the fast tier the promoted steps beyond the latest ``keep``."""
    on_fast = await committed_steps(fast)
    on_durable = set(await committed_steps(durable))
    for step in on_fast[:-keep]:
        if step in on_durable and await same_commit(fast, durable, step):
            await trim_step(fast, step)
