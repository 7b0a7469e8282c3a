"""Waiting on TensorStore futures: many at once, and past a cancellation.

Awaiting a TensorStore future on the event loop costs an asyncio future and a
GIL hand-off from TensorStore's thread; for thousands of small reads or writes
(small leaves, the merge's metadata checks) that overhead outweighs the I/O.

A cancelled `wait_all` cancels its futures and returns only once each has ended, so
nothing it started still writes after its caller unwinds (as with
`ckptstore.backends.base.finish_first`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import tensorstore as ts


async def wait_all(futures: Sequence[ts.Future[Any]]) -> list[Any]:
    """The results of many TensorStore futures, awaited by one worker thread.

    Awaiting each future on the event loop costs an asyncio future and a GIL
    hand-off per key; a batch of thousands of small writes is cheaper this way.
    Every future finishes before the first error is raised. Cancelled, it cancels the
    futures and returns once the worker thread has seen each of them end.
    """
    waiter = asyncio.ensure_future(asyncio.to_thread(_results, futures))
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        await asyncio.wait([waiter])
        if not waiter.cancelled():
            waiter.exception()  # retrieved: the cancellation is what propagates
        raise


def _results(futures: Sequence[ts.Future[Any]]) -> list[Any]:
    results, error = [], None
    for future in futures:
        try:
            results.append(future.result())
        except (Exception, asyncio.CancelledError) as exc:  # a cancelled future: see wait_all
            error = error or exc
    if error is not None:
        raise error
    return results
