"""The keep policy and promotion after each committed step, on `CheckpointManager`
(which inherits `Retention`): each step is promoted (tiers), then process 0 applies the keep
policy over the committed steps, a step dropped going from every tier; at start on tiers,
what a predecessor left unpromoted is promoted first. It runs on the manager's loop beside
the next save; its failure surfaces at the next `save` or `wait_until_finished`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ckptstore.api import delete_step
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.commit import committed_steps, load_committed
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptstore.lifecycle import policies as P
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.promote import promote
from ckptstore.tiers.target import Tiered

T = TypeVar("T")
log = logging.getLogger("ckptstore")


class Retention:
    """Promotion and the keep policy after each save (see the module docstring)."""

    if TYPE_CHECKING:  # what the manager provides
        backend: Backend
        durable: Backend | None
        keep_policy: P.KeepPolicy
        options: ManagerOptions
        resumed_promotions: list[int]
        _retention: concurrent.futures.Future[None] | None
        _records: dict[int, P.StepRecord]

        def _call(self, coro: Coroutine[Any, Any, T]) -> T: ...
        def _target(self) -> Backend | Tiered: ...

    async def _retain(self, step: int, previous: concurrent.futures.Future[None] | None) -> None:
        """The step is promoted (tiered; every process takes part, see `tiers.promote`), then
        process 0 applies the keep policy; every process waits until it has."""
        if previous is not None:
            await asyncio.wrap_future(previous)  # its failure is this one's too
        if isinstance(on := self._target(), Tiered):
            try:
                await promote(on, step, timeout=self.options.timeout)
            except CheckpointNotFoundError:  # deleted meanwhile (`ckptstore rm`): nothing to do
                log.info("ckptstore: step %d was deleted before its promotion", step)
        handoff = Handoff(f"manager/keep/{step}", self.options.timeout)
        seconds = await handoff.primary(self._apply_keep_policy)
        log.debug("ckptstore: keep policy after step %d took %s s", step, seconds)

    async def _resume(self) -> None:
        """On tiers, at start: finish what a predecessor left behind, in the background (its
        error surfaces like a keep policy's): promote every step the durable tier lacks,
        then apply the keep policy to both tiers."""
        done = await promote(self._target(), timeout=self.options.timeout)
        self.resumed_promotions = [p.step for p in done if not p.already]
        if self.resumed_promotions:
            log.info(
                "ckptstore: promoted steps %s that an earlier run left on the fast tier only",
                self.resumed_promotions,
            )
        await Handoff("manager/keep/resume", self.options.timeout).primary(self._apply_keep_policy)

    async def _apply_keep_policy(self) -> float:
        """Keep policy over the durable tier's steps (tiered) or the target's; a dropped step
        goes from every tier."""
        start = time.perf_counter()
        records = await self._step_records()
        if not records:
            return 0.0
        keep = self.keep_policy.keep(records, time.time())
        keep.add(max(r.step for r in records))  # never the latest committed step
        # On tiers, the one tier-aware delete: the fast tier first, leaving the deletion
        # record that stops a promotion in flight in any process (`promote_step`).
        target = self._target()
        for record in records:
            if record.step not in keep:
                try:
                    await delete_step(target, record.step)
                except CheckpointNotFoundError:  # its goal holds: another deleter was first
                    log.info("ckptstore: step %d was already deleted", record.step)
                self._records.pop(record.step, None)
        return time.perf_counter() - start

    async def _step_records(self) -> list[P.StepRecord]:
        """Every committed step with its time and metrics (manifests read once, cached)."""
        backend = self.durable or self.backend
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

    def _raise_retention_error(self) -> None:
        """The keep policy's (or a promotion's) failure, once, if it is over and failed."""
        retention = self._retention
        if retention is not None and retention.done() and retention.exception() is not None:
            self._retention = None
            retention.result()
