"""A manager's early refusal of a committed step, bounded: `ensure_uncommitted_on`.

Before staging anything, `CheckpointManager.save` refuses a step that is committed on its
target (tiered: on either tier; a step promoted and then dropped from the fast tier is
committed too), as `save_sync` does, instead of failing later at `wait()`. The check is a
listing per tier, so it can meet an object store that does not answer: it is bounded by the
manager's ``timeout``, and the durable tier's part as `ckptstore.tiers.bounded` says (no
answer within seconds: the save goes on to the fast tier, with a warning).
"""

from __future__ import annotations

import logging

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.commit import committed_steps, ensure_uncommitted
from ckptstore.checkpoint.staged import staged_steps
from ckptstore.runtime.futures import gather_first_error
from ckptstore.tiers.bounded import bounded, checking, durable_listing, durable_uncommitted

log = logging.getLogger("ckptstore")


async def ensure_uncommitted_on(
    fast: Backend, durable: Backend | None, step: int, timeout: float
) -> None:
    """`AlreadyExistsError` if ``step`` is committed on ``fast`` or ``durable`` (None: no
    durable tier); `RetriesExhaustedError` if ``fast`` gives no answer within ``timeout``
    seconds; the durable tier as the module docstring says."""
    checks = [bounded(ensure_uncommitted(fast, step), timeout, checking(step))]
    if durable is not None:
        checks.append(durable_uncommitted(durable, step, timeout))
    await gather_first_error(checks)


async def durable_steps(durable: Backend, timeout: float, fast: Backend) -> list[int] | None:
    """The steps committed on the durable tier, or None (with a warning) when it does not
    answer in time or fails (`durable_listing`): a manager opens, and lists its fast
    tier's steps, while object storage is down. Steps staged on a host-local ``fast``
    tier (`tiers.hostlocal`) are committed by their promotion only: while it waits they
    are not listed, and a warning names them."""
    steps = await durable_listing(committed_steps(durable), timeout, "its steps")
    if steps is None and (staged := await staged_steps(fast)):
        log.warning(
            "ckptstore: this host's fast tier %s holds steps %s staged (promoted, or waiting "
            "for the durable tier): until the durable tier answers, those waiting are not "
            "listed and cannot be restored",
            fast.url,
            staged,
        )
    return steps
