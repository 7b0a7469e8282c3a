"""A manager's early refusal of a committed step, bounded: `ensure_uncommitted_on`.

Before staging anything, `CheckpointManager.save` refuses a step that is committed on its
target (tiered: on either tier; a step promoted and then dropped from the fast tier is
committed too), as `save_sync` does, instead of failing later at `wait()`. The check is a
listing per tier, so it can meet an object store that does not answer: it is bounded by the
manager's ``timeout``. And the fast tier exists so that training keeps checkpointing while
object storage is down or slow: the durable tier is asked for at most
`DURABLE_CHECK_SECONDS`, and when it does not answer (or fails) the save goes on to the fast
tier with a warning; a step that was on the durable tier alone is then refused by its
promotion, which never replaces a committed step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.commit import committed_steps, ensure_uncommitted
from ckptstore.errors import AlreadyExistsError, RetriesExhaustedError, StorageError
from ckptstore.runtime.futures import gather_first_error

T = TypeVar("T")
log = logging.getLogger("ckptstore")

#: Seconds a tiered manager's save waits for the durable tier's answer.
DURABLE_CHECK_SECONDS = 2.0
#: Seconds a tiered manager waits for the durable tier's list of steps (at start, in
#: `all_steps`) before it goes on with the fast tier's alone.
DURABLE_LIST_SECONDS = 10.0


async def ensure_uncommitted_on(
    fast: Backend, durable: Backend | None, step: int, timeout: float
) -> None:
    """`AlreadyExistsError` if ``step`` is committed on ``fast`` or ``durable`` (None: no
    durable tier); `RetriesExhaustedError` if ``fast`` gives no answer within ``timeout``
    seconds; the durable tier as the module docstring says."""
    checks = [_bounded(ensure_uncommitted(fast, step), timeout, _checking(step))]
    if durable is not None:
        checks.append(_durable(durable, step, min(timeout, DURABLE_CHECK_SECONDS)))
    await gather_first_error(checks)


async def _durable(durable: Backend, step: int, seconds: float) -> None:
    try:
        await _bounded(ensure_uncommitted(durable, step), seconds, _checking(step), _DURABLE)
    except AlreadyExistsError:
        raise
    except StorageError as exc:  # unreachable, failing or too slow: the fast tier saves
        log.warning(
            "ckptstore: the durable tier did not say whether step %d is committed there "
            "(%s); saving it to the fast tier",
            step,
            exc,
        )


async def _bounded(
    work: Coroutine[Any, Any, T], seconds: float, what: str, bound: str = "ManagerOptions.timeout"
) -> T:
    """``work``'s result, or `RetriesExhaustedError` once ``seconds`` (``bound``) have
    passed (it is cancelled)."""
    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        raise RetriesExhaustedError(f"{what}: no answer within {seconds:g} s ({bound})") from None


_DURABLE = "the durable tier's wait"


def _checking(step: int) -> str:
    return f"checking whether step {step} is committed"


async def durable_steps(durable: Backend, timeout: float) -> list[int] | None:
    """The steps committed on the durable tier, or None (with a warning) when it does not
    answer within `DURABLE_LIST_SECONDS` (at most ``timeout``) or fails: a manager opens,
    and lists its fast tier's steps, while object storage is down."""
    return await durable_listing(committed_steps(durable), timeout, "its steps")


async def durable_listing(
    work: Coroutine[Any, Any, list[int]], timeout: float, what: str
) -> list[int] | None:
    """What the durable tier lists (``work``, listing ``what``), or None with a warning
    when it does not answer within `DURABLE_LIST_SECONDS` (at most ``timeout``) or fails."""
    seconds = min(timeout, DURABLE_LIST_SECONDS)
    try:
        return await _bounded(work, seconds, f"listing {what}", _DURABLE)
    except StorageError as exc:  # unreachable, failing or too slow: the fast tier's steps
        log.warning(
            "ckptstore: the durable tier did not list %s (%s); the fast tier's only", what, exc
        )
        return None
