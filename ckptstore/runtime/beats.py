"""Signs of life of one process's work in a collective round, so that the processes waiting
for its outcome wait as long as it works, and only as long.

A round's work can take longer than any fixed wait: a promotion of a terabyte-sized step, a
host's part of a large save on a slow link. A process doing a round's work publishes a beat
(``<prefix>/1``, ``<prefix>/2``, ...) every quarter of the wait (`beating`); a process waiting
for its outcome waits the whole ``timeout``, and again each time a new beat came meanwhile
(`wait_while_beating`): a process that died, or whose event loop stopped, is noticed within
one ``timeout`` as before, and one that works is waited for. The beat says the process runs,
not that its requests progress: those are bounded by the backends' own deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ckptstore.errors import CoordinationError
from ckptstore.runtime import distributed

#: Beats published per ``timeout`` of the processes waiting.
BEATS_PER_TIMEOUT = 4


@contextlib.asynccontextmanager
async def beating(prefix: str, timeout: float, alone: bool) -> AsyncIterator[None]:
    """Publish a beat under ``prefix`` every ``timeout / BEATS_PER_TIMEOUT`` seconds while
    the block runs (nothing when the process is ``alone``)."""
    if alone:
        yield
        return

    async def beat() -> None:
        n = 0
        while True:
            await asyncio.sleep(timeout / BEATS_PER_TIMEOUT)
            n += 1
            await distributed.kv_set(f"{prefix}/{n}", "")

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, CoordinationError):
            await task


async def wait_while_beating(key: str, prefix: str, timeout: float) -> str:
    """The value published under ``key``, waiting ``timeout`` seconds, and again as long as
    the process that publishes it beats under ``prefix`` (`beating`); `CoordinationError`
    after a ``timeout`` without the value nor a new beat."""
    seen = 0
    while True:
        try:
            return await distributed.kv_get(key, timeout)
        except CoordinationError:
            latest = seen
            while await distributed.kv_try_get(f"{prefix}/{latest + 1}") is not None:
                latest += 1
            if latest == seen:
                raise
            seen = latest
