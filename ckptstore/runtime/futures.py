"""Waiting on TensorStore futures (many at once, and past a cancellation), and keeping
CPU work off the event loop.

Awaiting a TensorStore future on the event loop costs an asyncio future and a
GIL hand-off from TensorStore's thread; for thousands of small reads or writes
(small leaves, the merge's metadata checks) that overhead outweighs the I/O.

A cancelled `wait_all` returns only once each future has ended (see
`finish_first`), so nothing it started still writes after its
caller unwinds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import tensorstore as ts

from ckptstore.errors import RetriesExhaustedError

T = TypeVar("T")

#: Copies, checksums and transfers of at least this many bytes run on a worker thread:
#: below it a thread hand-off costs more than the work, above it the work would hold the
#: event loop (and every other coroutine of the program) for milliseconds.
THREAD_BYTES = 1 << 20

#: Threads of their own (one per core): in the event loop's default executor this work
#: would take the threads that file reads and waits on TensorStore's futures need.
_CPU = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2, "ckptstore-cpu")


async def finish_first(work: Awaitable[T]) -> T:
    """Await ``work``; if the awaiting task is cancelled meanwhile, wait for ``work`` to
    finish (its result or error dropped) before the cancellation goes on.

    For writes that a cancelled await does not stop (a worker thread's, TensorStore's):
    a cancelled save (Ctrl-C in a blocking call) has stopped writing once it unwinds.
    """
    inner = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        await asyncio.wait([inner])
        if not inner.cancelled():
            inner.exception()  # retrieved: no "exception was never retrieved" warning
        raise


class _Job(Generic[T]):
    """One piece of work for a worker thread whose result reaches the caller without the
    thread keeping a reference to it, or to what the work closed over.

    An executor's worker holds what the function returned (and the function) until its
    thread runs again after setting the future's result, while the awaiting coroutine may
    already have returned: under load, a restore's buffers (or a save's arrays) outlived
    the call that returned them. Here the worker's own result is None and the work is
    dropped before the future is set; the caller takes the value out (`take`)."""

    def __init__(self, work: Callable[[], T]):
        self._work: Callable[[], T] | None = work
        self._out: tuple[T] | None = None

    def __call__(self) -> None:
        work, self._work = self._work, None
        assert work is not None, "a job runs once"
        self._out = (work(),)

    def take(self) -> T:
        out, self._out = self._out, None
        assert out is not None, "the job did not run"
        return out[0]


async def on_thread(executor: concurrent.futures.Executor | None, work: Callable[[], T]) -> T:
    """``work()`` on ``executor`` (None: the loop's default one), in the caller's context;
    a cancellation waits for it to end. Once this returns, no worker thread holds the
    result or the work (`_Job`)."""
    context = contextvars.copy_context()
    job = _Job(functools.partial(context.run, work))
    await finish_first(asyncio.get_running_loop().run_in_executor(executor, job))
    return job.take()


async def off_loop(work: Callable[[], T], nbytes: int) -> T:
    """``work()``, on a worker thread when it handles ``nbytes`` >= `THREAD_BYTES`; a
    cancellation waits for it to end (it may be writing into memory the caller owns)."""
    if nbytes < THREAD_BYTES:
        return work()
    return await on_thread(_CPU, work)


async def wait_all(futures: Sequence[ts.Future[Any]], limit: float | None = None) -> list[Any]:
    """The results of many TensorStore futures, awaited by one worker thread.

    Awaiting each future on the event loop costs an asyncio future and a GIL
    hand-off per key; a batch of thousands of small writes is cheaper this way.
    Every future finishes before the first error is raised, or before a cancellation goes
    on: a cancelled TensorStore future does not stop the I/O it started, so its writes are
    left to finish rather than to land after the caller has moved on.

    ``limit``: seconds for them all (a retry policy's deadline); past it every future is
    cancelled (TensorStore drops its requests) and `RetriesExhaustedError` is raised.
    """
    return await on_thread(None, lambda: wait_here(futures, limit))


def wait_here(futures: Sequence[ts.Future[Any]], limit: float | None = None) -> list[Any]:
    """`wait_all` on the calling thread (a worker thread: this blocks)."""
    results: list[Any] = []
    error: BaseException | None = None
    end = None if limit is None else time.monotonic() + limit
    for future in futures:
        try:
            if end is None:
                results.append(future.result())
            else:
                results.append(future.result(timeout=max(0.0, end - time.monotonic())))
        except TimeoutError:
            for each in futures:
                each.cancel()
            error = error or RetriesExhaustedError(
                f"TensorStore requests: no result within the {limit:.0f} s deadline (retry policy)"
            )
        except (Exception, asyncio.CancelledError) as exc:  # a cancelled future: see wait_all
            error = error or exc
    if error is not None:
        raise error
    return results


def write_keys(
    kv: ts.KvStore,
    items: Iterable[tuple[str, bytes]],
    limit: float | None,
    *,
    one_commit: bool = False,
) -> None:
    """Write each (key, value) of ``items`` into ``kv``, all issued before any is waited for,
    on the calling thread (a worker thread: this blocks); if making an item fails, the
    writes already issued end first, then the error is raised. ``one_commit``: in one
    transaction, committed at the end (an OCDBT store then takes them in one commit, where
    separate writes take one per batch that arrives while the previous commits)."""
    txn = ts.Transaction() if one_commit else None
    target = kv if txn is None else kv.with_transaction(txn)
    writes: list[ts.Future[Any]] = []
    try:
        for key, value in items:
            writes.append(target.write(key, value))
    except BaseException:
        with contextlib.suppress(Exception):
            wait_here(writes, limit)
        if txn is not None:
            txn.abort()
        raise
    wait_here(writes, limit)
    if txn is not None:
        wait_here([txn.commit_async()], limit)


async def gather_first_error(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run awaitables concurrently; on the first failure cancel the rest and raise that failure.

    (`asyncio.gather` alone would let the others run on, e.g. keep uploading
    parts of an upload that is being aborted.)
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
