"""A manager's early refusal of a committed step, bounded: `ensure_uncommitted_on`.

Before staging anything, `CheckpointManager.save` refuses a step that is committed on its
target (tiered: on either tier; a step promoted and then dropped from the fast tier is
committed too), as `save_sync` does, instead of failing later at `wait()`. The check is a
listing per tier, so it can meet an object store that does not answer: it is bounded by the
manager's ``timeout``, and the durable tier's part as `ckptstore.tiers.bounded` says (no
answer within seconds: the save goes on to the fast tier, with a warning). Process 0 asks
for every process.
"""

from __future__ import annotations

from ckptstore.backends.base import Backend
from ckptstore.protocol import ensure_uncommitted
from ckptstore.runtime.futures import gather_first_error
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.bounded import bounded, checking, durable_uncommitted


async def ensure_uncommitted_on(
    fast: Backend, durable: Backend | None, step: int, timeout: float
) -> None:
    """`AlreadyExistsError` if ``step`` is committed on ``fast`` or ``durable`` (None: no
    durable tier); `RetriesExhaustedError` if ``fast`` gives no answer within ``timeout``
    seconds; the durable tier as the module docstring says. With several processes,
    process 0 asks and every process gets its answer: a durable tier that answered one
    process and not another would otherwise send one into the save and the other not."""

    async def check() -> None:
        checks = [bounded(ensure_uncommitted(fast, step), timeout, checking(step))]
        if durable is not None:
            checks.append(durable_uncommitted(durable, step, timeout))
        await gather_first_error(checks)

    await Handoff(f"manager/exists/{step}", timeout).primary(check)
