"""A failed save's cleanup: its attempt removed at once, so what it wrote (on a full disk,
the space the next save needs) goes without waiting for `gc`.

Process 0 claims the attempt's fate (`ABANDON`: a `gc` that decided first wins, and then
the attempt is gc's) once every process reported the end of its writes, and clears it
until it stays empty (TensorStore may still land a data file of a failed commit). Split
from `ckptstore.checkpoint.save`, which calls `discard` and `root_missing` on failure.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ckptstore.backends.base import Backend
from ckptstore.errors import CkptStoreError, FencedError, NotFoundError
from ckptstore.protocol import Attempt
from ckptstore.runtime.handoff import Handoff

log = logging.getLogger("ckptstore")


#: How long process 0 of a failed save waits for the others to stop writing (each reports
#: when its writes end) before it removes the attempt; past it, `gc` removes it later.
DISCARD_WAIT = 60.0


async def root_missing(backend: Backend) -> NotFoundError | None:
    """After a write found nothing to write into: whether the root itself is missing (a
    bucket that does not exist, a directory deleted meanwhile). Then there is no attempt to
    discard or leave for gc, and that, not a key, is what the save's error should name.
    (Asked only on failure: a check before every save would cost a request each.)"""
    try:
        await backend.check_root()
    except NotFoundError as exc:
        return exc
    except CkptStoreError:
        return None
    return None


async def discard(attempt: Attempt, handoff: Handoff) -> None:
    """Remove the attempt of a save that failed before its commit began, so that what it
    wrote (on a full disk: the space the next save needs) goes at once. Process 0 removes
    it once every process has reported the end of its writes (within `DISCARD_WAIT`
    seconds; a process that never reports may still be writing, so then, as on any error
    here, the attempt is left to `gc`), after claiming its fate (its own commit claim
    counts; one that `gc` won is gc's to remove)."""
    if handoff.me != 0:
        return
    where = attempt.where
    if not await handoff.settled(min(handoff.timeout, DISCARD_WAIT)):
        log.warning("a failed save left attempt %s for gc: not every process reported", where.root)
        return
    try:
        await attempt.abandon()
        removed = await cleared_until_quiet(attempt)
    except FencedError:
        log.info("a failed save's attempt %s is gc's (it decided first)", where.root)
        return
    except Exception as exc:  # the save's own error is the one to raise
        log.warning("a failed save left attempt %s for gc: %s", where.root, exc)
    else:
        log.info("a failed save's attempt %s removed (%d objects)", where.root, removed)


async def cleared_until_quiet(attempt: Attempt) -> int:
    """Clear an abandoned attempt until it stays empty, then drop its fate record.

    The writes of the failed save have all been awaited, but TensorStore may still be
    ending one it had in flight: a data file of the same commit, whose write future
    resolved once the commit failed (seen under load on a full disk: a data file landed
    after the first clear had listed the attempt). The attempt is listed again, with
    growing pauses, until two listings find nothing (at most `STRAGGLER_WAIT` seconds); its
    ABANDON fate stays meanwhile, so nobody can claim it. Returns the objects removed."""
    removed = await attempt.clear(keep_fate=True)
    delay, quiet, deadline = 0.05, 0, time.monotonic() + STRAGGLER_WAIT
    while quiet < 2 and time.monotonic() < deadline:
        await asyncio.sleep(delay)
        more = await attempt.clear(keep_fate=True)
        removed += more
        quiet = quiet + 1 if more == 0 else 0
        delay = min(2 * delay, 0.4)
    return removed + await attempt.clear(keep_fate=False)


#: How long a failed save's cleanup waits for TensorStore's last writes (`cleared_until_quiet`).
STRAGGLER_WAIT = 3.0
