"""The durable tier's answers, bounded: the fast tier exists so that training keeps
checkpointing while object storage is down or slow, so what a save or a manager asks the
durable tier before it goes on is asked for a few seconds at most, and a durable tier that
does not answer (or fails) is warned about and left out, never waited on for minutes.

- `durable_uncommitted`: whether a step is committed on the durable tier, asked for at most
  `DURABLE_CHECK_SECONDS`; no answer lets the save go on to the fast tier (a step that was
  on the durable tier alone is then refused by its promotion, which never replaces a
  committed step);
- `durable_listing`: what the durable tier lists, asked for at most `DURABLE_LIST_SECONDS`;
  no answer is None, and the caller goes on with the fast tier's (`durable_steps`: its
  committed steps).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptstore.backends.base import Backend
from ckptstore.errors import AlreadyExistsError, RetriesExhaustedError, StorageError
from ckptstore.protocol import committed_steps, ensure_uncommitted

T = TypeVar("T")
log = logging.getLogger("ckptstore")

#: Seconds a save on tiers waits for the durable tier's "is this step committed?".
DURABLE_CHECK_SECONDS = 2.0
#: Seconds a tiered manager waits for the durable tier's list of steps (at start, in
#: `all_steps`) before it goes on with the fast tier's alone.
DURABLE_LIST_SECONDS = 10.0
_DURABLE = "the durable tier's wait"


async def bounded(
    work: Coroutine[Any, Any, T], seconds: float, what: str, bound: str = "ManagerOptions.timeout"
) -> T:
    """``work``'s result, or `RetriesExhaustedError` once ``seconds`` (``bound``) have
    passed (it is cancelled)."""
    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        raise RetriesExhaustedError(f"{what}: no answer within {seconds:g} s ({bound})") from None


def checking(step: int) -> str:
    return f"checking whether step {step} is committed"


async def durable_uncommitted(durable: Backend, step: int, timeout: float) -> None:
    """`AlreadyExistsError` if ``step`` is committed on ``durable``; if the durable tier
    gives no answer within `DURABLE_CHECK_SECONDS` (at most ``timeout``) or fails, a warning
    and nothing else (the module docstring)."""
    seconds = min(timeout, DURABLE_CHECK_SECONDS)
    try:
        await bounded(ensure_uncommitted(durable, step), seconds, checking(step), _DURABLE)
    except AlreadyExistsError:
        raise
    except StorageError as exc:  # unreachable, failing or too slow: the fast tier saves
        log.warning(
            "ckptstore: the durable tier did not say whether step %d is committed there "
            "(%s); saving it to the fast tier",
            step,
            exc,
        )


async def durable_listing(
    work: Coroutine[Any, Any, list[int]], timeout: float, what: str
) -> list[int] | None:
    """What the durable tier lists (``work``, listing ``what``), or None with a warning
    when it does not answer within `DURABLE_LIST_SECONDS` (at most ``timeout``) or fails."""
    seconds = min(timeout, DURABLE_LIST_SECONDS)
    try:
        return await bounded(work, seconds, f"listing {what}", _DURABLE)
    except StorageError as exc:  # unreachable, failing or too slow: the fast tier's steps
        log.warning(
            "ckptstore: the durable tier did not list %s (%s); the fast tier's only", what, exc
        )
        return None


async def durable_steps(durable: Backend, timeout: float) -> list[int] | None:
    """The steps committed on the durable tier, or None (with a warning) when it does not
    answer in time or fails (`durable_listing`): a manager opens, and a restore finds the
    latest step, with the fast tier's while object storage is down."""
    return await durable_listing(committed_steps(durable), timeout, "its steps")
