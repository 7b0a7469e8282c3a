"""An Orbax `CheckpointManager` root under ckptstore's manager: read, never written.

A manager opened where Orbax saved (and ckptstore committed nothing) restores and ranks the
Orbax steps as its own, and refuses every save with a message that says how to move the run
(`OrbaxRoot.refusal`): Orbax's listings would otherwise show ckptstore's step directories
as its own, and ckptstore's Orbax's. The manager holds one `OrbaxRoot`, asked at open and
at `reload` (`look`); its steps are empty wherever ckptstore steps are committed.
"""

from __future__ import annotations

import asyncio
import shlex

from ckptstore.backends.base import Backend
from ckptstore.errors import CheckpointNotFoundError, UnsupportedOperationError
from ckptstore.format import layout
from ckptstore.lifecycle.policies import StepRecord
from ckptstore.orbax import items as orbax_items
from ckptstore.orbax import steps as orbax
from ckptstore.tiers.bounded import durable_listing


class OrbaxRoot:
    """The Orbax steps at a manager's target (the fast tier first on tiers): ``steps``,
    ascending, and ``refusal``, why every save is refused (None: not an Orbax root)."""

    def __init__(self, backend: Backend, durable: Backend | None, timeout: float) -> None:
        self.backend, self.durable, self.timeout = backend, durable, timeout
        self.steps: list[int] = []
        self.refusal: str | None = None
        self._records: dict[int, StepRecord] = {}  # until the next `look`

    async def look(self, committed: list[int]) -> None:
        """Find the Orbax steps again (none where ``committed``, ckptstore's committed
        steps, is not empty), and forget the records read so far."""
        self._records.clear()
        self.steps = [] if committed else await self.finalized_steps()
        self.refusal = await self._refusal() if self.steps else None

    def refuse(self) -> None:
        """`UnsupportedOperationError` on an Orbax root, before anything is written."""
        if self.refusal is not None:
            raise UnsupportedOperationError(self.refusal)

    async def record(self, step: int) -> StepRecord:
        """Orbax step ``step`` as keep policies see a step: its metrics (its ``metrics``
        item, checked as `orbax_items.read_metrics` does) and commit time; kept until the
        next `look`. `CheckpointNotFoundError` naming the Orbax steps there are where
        ``step`` is not one."""
        if step in self._records:
            return self._records[step]
        found = await self._where(step)
        if found is None:
            raise CheckpointNotFoundError(
                f"step {step} is not a finalized Orbax step; Orbax steps: "
                f"{await self.finalized_steps()}",
                backend=self.backend.url,
            )
        holder, where = found
        committed = (await orbax_items.step_metadata(holder, where)).committed
        metrics = await orbax_items.read_metrics(holder, where) or {}
        self._records[step] = StepRecord(step, committed or 0.0, metrics)
        return self._records[step]

    async def records(self) -> list[StepRecord]:
        """Every finalized Orbax step's record (`record`), ascending."""
        return [await self.record(step) for step in await self.finalized_steps()]

    async def finalized_steps(self) -> list[int]:
        """Finalized Orbax steps on the target (either tier; a durable tier that does not
        answer, bounded as its listing of steps is, has none), ascending."""

        async def on_durable() -> list[int]:
            if self.durable is None:
                return []
            work = orbax.finalized_steps(self.durable)
            return await durable_listing(work, self.timeout, "Orbax steps") or []

        found = await asyncio.gather(orbax.finalized_steps(self.backend), on_durable())
        return sorted(set().union(*found))

    async def _where(self, step: int) -> tuple[Backend, str] | None:
        """The tier holding Orbax step ``step`` (the fast one first) and its directory."""
        for holder in (self.backend, self.durable):
            if holder is not None and (where := await orbax.locate(holder, step)) is not None:
                return holder, where
        return None

    async def _refusal(self) -> str:
        """What `refuse` says, with the way on for the latest Orbax step: ``ckptstore
        import-orbax`` into a new root, which imports every item of the step into one step
        (Orbax's names kept, its lone ``default`` tree as "state"), then a manager there;
        with several items, how to restore them all; with metrics (a ``best_fn`` run), how
        to import every step."""
        latest = self.steps[-1]
        holder, where = await self._where(latest) or (self.backend, layout.step_dir(latest))
        kinds = await orbax_items.item_kinds(holder, where)  # unchecked: only for the advice
        names = [n for n in kinds if n != orbax_items.METRICS]  # the step's metrics come too
        said = (
            f"{holder.url} is an Orbax CheckpointManager root (steps {self.steps}): the "
            "manager restores its steps but does not save beside them"
        )
        how = (
            f"import the latest step into a new root (`ckptstore import-orbax "
            f"{shlex.quote(holder.url)} NEW_ROOT --step {latest}`) and point the manager there"
        )
        if orbax_items.METRICS in kinds:  # saved with metrics: a best_fn run's history
            how += (
                f" (`--all-steps` in place of `--step {latest}` imports every step with its "
                "metrics, so that best_step() and KeepBest keep the run's best steps)"
            )
        if len(names) <= 1:
            return f"{said}. To resume in ckptstore format, {how}"
        items = "{" + ", ".join(f"{n!r}: None" for n in names) + "}"
        return (
            f"{said}. To resume in ckptstore format, {how}: the import keeps every item of "
            f"step {latest} ({names}) under its name in one step, and "
            f"`mgr.restore({latest}, items={items})` there restores them all"
        )
