"""The keep policy and promotion after each committed step, by the `Retention` a
`CheckpointManager` holds: each step is promoted (tiers), then process 0 applies the keep
policy over the committed steps, a step dropped going from every tier; at start on tiers,
what a predecessor left unpromoted is promoted first. While the durable tier is down, the
promotion waits (`unpromoted`) and the keep policy applies to the fast tier alone. It runs
on the manager's loop beside the next save; its failure surfaces at the next `save` or
`wait_until_finished`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import Coroutine, Iterable
from typing import Any

from ckptstore.api import delete_step
from ckptstore.backends.base import Backend
from ckptstore.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TransientStorageError,
)
from ckptstore.format.manifest import Manifest
from ckptstore.lifecycle import policies as P
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.protocol import committed_steps, load_committed
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.promote import Promotion, promote, trim_fast
from ckptstore.tiers.target import Tiered

log = logging.getLogger("ckptstore")


class Retention:
    """Promotion and the keep policy after each save (see the module docstring), for a
    manager saving to ``target`` (its open backend, or both open tiers with their settings)
    with ``keep_policy``. ``records`` (step -> `StepRecord`) and ``staged`` (host-local
    fast tiers' steps not promoted yet, `tiers.offline`) are the manager's, shared;
    ``waiting``: the steps known to wait for their promotion at start."""

    def __init__(
        self,
        target: Backend | Tiered,
        keep_policy: P.KeepPolicy,
        options: ManagerOptions,
        count: int,
        records: dict[int, P.StepRecord],
        staged: dict[int, Manifest],
        waiting: Iterable[int] = (),
    ) -> None:
        self.target, self.keep_policy, self.options = target, keep_policy, options
        fast = target.fast if isinstance(target, Tiered) else target
        durable = target.durable if isinstance(target, Tiered) else None
        assert isinstance(fast, Backend) and (durable is None or isinstance(durable, Backend))
        self.backend: Backend = fast
        self.durable: Backend | None = durable
        self._count, self._records, self._staged = count, records, staged
        #: Steps committed on the fast tier while the durable tier was down, promoted at
        #: the next save's turn once it answers (`CheckpointManager.unpromoted`).
        self.unpromoted: set[int] = set(waiting)
        #: Steps committed whose promotion has not ended yet (`retain`).
        self.promoting: set[int] = set()
        #: Steps a predecessor left unpromoted, promoted at start (`resume`).
        self.resumed: list[int] = []
        #: The turn running now (or last), after the step committed last.
        self.future: concurrent.futures.Future[None] | None = None
        self._starting: concurrent.futures.Future[None] | None = None  # `start`'s

    def after(self, step: int, loop: asyncio.AbstractEventLoop) -> None:
        """Schedule ``step``'s turn on ``loop`` (the step is committed): after the turn
        before it, beside the next save if there is one (it only deletes committed steps)."""
        if self.durable is not None:
            self.promoting.add(step)  # until its turn in `retain` ends
        self.future = asyncio.run_coroutine_threadsafe(self.retain(step, self.future), loop)

    def take(self) -> concurrent.futures.Future[None] | None:
        """The turn in flight (or done), forgotten here: the caller waits for it."""
        future, self.future = self.future, None
        return future

    def start(self, work: Coroutine[Any, Any, None], loop: asyncio.AbstractEventLoop) -> None:
        """Run a manager's start-up ``work`` on ``loop``: the first step's turn comes after
        it, and its failure surfaces as a turn's; it is no save's, so not `busy`."""
        self.future = self._starting = asyncio.run_coroutine_threadsafe(work, loop)

    def busy(self) -> bool:
        """Whether a step's turn is still running (start-up work aside)."""
        future = self.future
        return future is not None and future is not self._starting and not future.done()

    async def retain(self, step: int, previous: concurrent.futures.Future[None] | None) -> None:
        """The step is promoted (tiered; every process takes part, see `tiers.promote`), then
        process 0 applies the keep policy; every process waits until it has. While the
        durable tier is down, what it lacks is promoted at the next chance."""
        try:
            if previous is not None:
                await asyncio.wrap_future(previous)  # its failure is this one's too
            on = self.target
            deferred = isinstance(on, Tiered) and await self._promote_or_defer(on, step) is None
        finally:
            self.promoting.discard(step)  # promoted, deferred (`unpromoted`) or failed
        if deferred:  # the durable tier is down: the fast tier alone
            await self._keep_on_fast_tier(f"manager/keep/{step}")
            return
        await self._keep(f"manager/keep/{step}")

    async def _keep(self, name: str) -> None:
        """The keep policy over both tiers (or the target), process 0 applying it. On tiers,
        a durable tier that goes away meanwhile (after the promotion that came before) leaves
        it to the fast tier alone, with a warning (every process learns of it from process
        0): the next save's turn applies it to both once the durable tier answers."""
        try:
            seconds = await Handoff(name, self.options.timeout).primary(self._apply_keep_policy)
        except TransientStorageError as exc:
            if self.durable is None:
                raise
            log.warning(
                "ckptstore: the durable tier did not answer the keep policy (%s); applied to "
                "the fast tier alone, to both once it answers again",
                exc,
            )
            await self._keep_on_fast_tier(name)
            return
        log.debug("ckptstore: keep policy (%s) took %s s", name, seconds)

    async def _promote_or_defer(self, on: Tiered, step: int | None) -> list[Promotion] | None:
        """Promote ``step`` (None: every step the durable tier lacks), and whatever an
        earlier promotion left while the durable tier was down; what was promoted, or None
        if the durable tier did not answer: the promotion is deferred, with a warning, and
        `unpromoted` says what waits. Promotion is collective (`tiers.promote`): a process
        that meets the outage publishes it, and every process defers alike."""
        behind = step is None or bool(self.unpromoted)
        if self._count == 1:  # ``keep_fast`` trims after the keep policy (`_trim_fast`)
            on = dataclasses.replace(on, keep_fast=None)
        try:
            done = await promote(on, None if behind else step, timeout=self.options.timeout)
        except CheckpointNotFoundError:  # deleted meanwhile (`ckptstore rm`, the keep policy)
            log.info("ckptstore: step %s was deleted before its promotion", step)
            self.unpromoted.discard(step)  # what else waits still does: the next turn's
            return []
        except TransientStorageError as exc:
            if step is not None:
                self.unpromoted.add(step)
            log.warning(
                "ckptstore: the durable tier is unavailable; steps %s stay on the fast tier "
                "and are promoted when it answers again (%s)",
                sorted(self.unpromoted) or "(those it lacks)",
                exc,
            )
            return None
        if self.unpromoted:
            log.info("ckptstore: the durable tier caught up: %s", [p.step for p in done])
        self.unpromoted.clear()
        self._staged.clear()  # promoted: read like any committed step from now on
        return done

    async def resume(self) -> None:
        """On tiers, at start: finish what a predecessor left behind, in the background (its
        error surfaces like a keep policy's): promote every step the durable tier lacks,
        then apply the keep policy to both tiers."""
        on = self.target
        assert isinstance(on, Tiered)
        done = await self._promote_or_defer(on, None)
        if done is None:
            return
        self.resumed = [p.step for p in done if not p.already]
        if self.resumed:
            log.info(
                "ckptstore: promoted steps %s that an earlier run left on the fast tier only",
                self.resumed,
            )
        await self._keep("manager/keep/resume")

    async def catch_up(self, seconds: float) -> None:
        """Promote what waits (`unpromoted`) and apply the keep policy, if the durable tier
        answers within ``seconds``; else say what stays on the fast tier (promotion is
        resumable: the next manager on these tiers, or ``ckptstore promote``, finishes it)."""
        on = self.target
        assert isinstance(on, Tiered)
        try:
            done = await asyncio.wait_for(self._promote_or_defer(on, None), seconds)
        except TimeoutError:
            done = None
        if done is None:
            log.warning(
                "ckptstore: steps %s remain on the fast tier only: the durable tier did not "
                "answer; the next manager on these tiers (or `ckptstore promote`) promotes them",
                sorted(self.unpromoted),
            )
            return
        await self._keep("manager/keep/close")

    async def _keep_on_fast_tier(self, name: str) -> None:
        """The keep policy over the fast tier's steps alone, while the durable tier is down,
        process 0 applying it: a step it drops leaves the fast tier (on the durable tier, if
        it is there, the keep policy drops it once that tier answers again). Host-local fast
        tiers hold staged parts, never committed steps: they wait for their promotion."""

        async def drop() -> str:
            dropped = await self._drop_unkept(await self.step_records(self.backend), self.backend)
            return json.dumps(dropped or [])

        # Every process learns what was dropped: none waits for its promotion any more.
        dropped = json.loads(await Handoff(f"{name}/fast", self.options.timeout).agree(drop))
        self.unpromoted.difference_update(dropped)

    async def _apply_keep_policy(self) -> float:
        """Keep policy over the durable tier's steps (tiered) or the target's; a dropped step
        goes from every tier."""
        start = time.perf_counter()
        # On tiers, the one tier-aware delete: the fast tier first, leaving the deletion
        # record that stops a promotion in flight in any process (`promote_step`).
        target = self.target
        records = await self.step_records(self.durable or self.backend)
        if await self._drop_unkept(records, target) is not None:
            await self._trim_fast(target)
        return time.perf_counter() - start

    async def _drop_unkept(
        self, records: list[P.StepRecord], target: Backend | Tiered
    ) -> list[int] | None:
        """Delete from ``target`` the steps of ``records`` the keep policy does not keep
        (never the latest); the steps deleted, None if there were no records."""
        if not records:
            return None
        dropped = []
        keep = self.keep_policy.keep(records, time.time())
        keep.add(max(r.step for r in records))  # never the latest committed step
        for record in records:
            if record.step not in keep:
                try:
                    await delete_step(target, record.step)
                except CheckpointNotFoundError:  # its goal holds: another deleter was first
                    log.info("ckptstore: step %d was already deleted", record.step)
                self._records.pop(record.step, None)
                self.unpromoted.discard(record.step)
                dropped.append(record.step)
        return dropped

    async def _trim_fast(self, target: Backend | Tiered) -> None:
        """``keep_fast``: the latest promoted steps the keep policy kept stay on the fast
        tier, the older promoted ones leave it. After the keep policy, not inside the
        promotion: trimming first counted steps the policy deleted next, and the fast tier
        ended with fewer than ``keep_fast`` (one process; with several, `promote` trims)."""
        if isinstance(target, Tiered) and target.keep_fast is not None and self._count == 1:
            assert self.durable is not None
            await trim_fast(self.backend, self.durable, target.keep_fast)

    async def step_records(self, backend: Backend) -> list[P.StepRecord]:
        """Every step committed on ``backend`` with its time and metrics (manifests read
        once, cached)."""
        steps = await committed_steps(backend)
        for step in steps:
            if step not in self._records:
                try:
                    manifest = await load_committed(backend, step)
                except CheckpointNotFoundError:  # deleted since the listing: nothing to keep
                    continue
                except CorruptCheckpointError as exc:  # never deleted on a guess
                    log.warning("ckptstore: step %d is unreadable, kept: %s", step, exc)
                    continue
                metrics = manifest.metadata.get("metrics", {})
                self._records[step] = P.StepRecord(
                    step, manifest.created, metrics if isinstance(metrics, dict) else {}
                )
        return [self._records[s] for s in steps if s in self._records]

    def raise_error(self) -> None:
        """The keep policy's (or a promotion's) failure, once, if it is over and failed."""
        retention = self.future
        if retention is not None and retention.done() and retention.exception() is not None:
            self.future = None
            retention.result()
