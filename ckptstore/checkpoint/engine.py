"""The commit engine: the end of every step that commits, on process 0, whoever wrote it.

A save (`ckptstore.checkpoint.save`, with a `ckptstore.checkpoint.saveplan.SavePlan`) and a
partial save's finalize (`ckptstore.checkpoint.partial`, with its session's plan) both end in
`commit_step`, each with a `Plan` of what its writers recorded. Its phases, in order:

1. claim: the attempt's fate is claimed for its commit (`Attempt.claim`; a `gc`, an abandon
   or a zombie that decided first wins, and the step fails with `FencedError`) while the
   plan joins the writers' records (`Plan.join`: reads and arithmetic, nothing written), so
   an attempt that is not ours is never merged;
2. merge: each item's stores merged by reference into one store, validated, and the
   attempt's manifest built (`Plan.merge`);
3. finish: the manifest written and the marker created (`Attempt.commit`), or what the
   caller does instead (a host-local fast tier stages the step: `ckptstore.tiers.save`).

Nothing before the finish is visible to a reader; after it the step is committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from ckptstore.format.manifest import Manifest
from ckptstore.protocol import COMMIT, Attempt, Fate

#: What finishes a merged step: its manifest and the won fate -> committed (or staged).
Finish = Callable[[Manifest, Fate], Awaitable[object]]


class Plan(Protocol):
    """What a step's writers recorded, as the engine drives it."""

    async def join(self) -> None:
        """Phase 1: the writers' records, read and joined; nothing is written."""

    async def merge(self) -> Manifest:
        """Phase 2, the fate claimed: the items merged and validated; the manifest."""


async def commit_step(attempt: Attempt, plan: Plan, finish: Finish | None = None) -> Manifest:
    """Phases 1 to 3 of the module docstring for ``attempt``; ``finish`` replaces the commit
    (default: `Attempt.commit`). Returns the manifest."""
    claiming = asyncio.ensure_future(attempt.claim(COMMIT))
    try:
        await plan.join()
    finally:
        fate = await claiming  # its error first: a fenced attempt is not merged
    manifest = await plan.merge()
    await (finish or attempt.commit)(manifest, fate)
    return manifest
