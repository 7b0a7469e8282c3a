"""Running async work from blocking code: one private event-loop thread for the whole
process, and `blocking`, which makes the ``_sync`` twin of an async function.

The twins run their coroutine on that thread, so they work whether or not the caller
already runs an event loop, and backends opened for them stay on one loop. Ctrl-C (or
any exception raised in the waiting thread, such as `KeyboardInterrupt`) cancels the
running work and waits until it has stopped before it propagates: nothing keeps writing
behind the caller's back. A second Ctrl-C while that cancellation runs stops waiting.

Every twin is made by `blocking` from its async function, so it has that function's
parameters and types: `inspect.signature`, ``help()``, IDEs and mypy see them
(``save_sync(root, tree, step="3")`` is a type error, as it is for ``save``).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar, overload

T = TypeVar("T")
R = TypeVar("R")
Params = ParamSpec("Params")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def background_loop() -> asyncio.AbstractEventLoop:
    """The process's one background event loop (started on first use): the `_sync` twins'
    and every `CheckpointManager`'s."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ckptstore-loop", daemon=True).start()
            atexit.register(_finish_async_generators, _loop)
        return _loop


#: Seconds `_finish_async_generators` waits at exit.
EXIT_WAIT = 10.0


def _finish_async_generators(loop: asyncio.AbstractEventLoop) -> None:
    """At interpreter exit, close the async generators still open on the background loop
    (a `partial_save_sync` session never closed holds its backend in one), while the loop
    still runs: left to the garbage collector during shutdown, each would print an
    ``AttributeError`` traceback from asyncio's finalizer instead of closing."""
    if not loop.is_running():
        return
    future = asyncio.run_coroutine_threadsafe(loop.shutdown_asyncgens(), loop)
    try:
        future.result(EXIT_WAIT)
    except Exception:  # exiting anyway: a backend that does not close is not worth a traceback
        future.cancel()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on the background loop and return its result.

    Interrupted while waiting (Ctrl-C), it cancels ``coro`` and waits for it to
    finish unwinding before re-raising, so no write outlives the call.
    """
    loop = background_loop()
    done = threading.Event()
    started: list[asyncio.Task[T]] = []

    def start() -> None:
        task = loop.create_task(coro)
        task.add_done_callback(lambda _: done.set())
        started.append(task)

    loop.call_soon_threadsafe(start)
    try:
        _wait(done)
    except BaseException:
        loop.call_soon_threadsafe(lambda: started[0].cancel())  # runs after `start`
        _wait(done)  # a second interrupt ends this wait and propagates
        raise
    return started[0].result()


def _wait(done: threading.Event) -> None:
    """Wait for ``done`` in short slices: the kernel may deliver SIGINT to any thread
    (TensorStore's, a worker's), and Python runs its handler only once the main thread
    runs again, which a wait without a timeout would put off until the work is done."""
    while not done.wait(0.05):
        pass


@overload
def blocking(fn: Callable[Params, Coroutine[Any, Any, T]]) -> Callable[Params, T]: ...


@overload
def blocking(
    fn: Callable[Params, Coroutine[Any, Any, T]], then: Callable[[T], R]
) -> Callable[Params, R]: ...


def blocking(
    fn: Callable[Params, Coroutine[Any, Any, T]], then: Callable[[T], Any] | None = None
) -> Callable[Params, Any]:
    """The blocking twin of the async function ``fn``, named ``<fn>_sync`` in the calling
    module: ``fn``'s parameters and types, its result (or ``then(result)``) returned once
    `run` has run it to completion."""

    def twin(*args: Params.args, **kwargs: Params.kwargs) -> Any:
        result = run(fn(*args, **kwargs))
        return result if then is None else then(result)

    twin.__name__ = twin.__qualname__ = f"{fn.__name__}_sync"
    twin.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    doc = inspect.cleandoc(fn.__doc__ or "")
    twin.__doc__ = f"`ckptstore.{fn.__name__}`, blocking (see `ckptstore.runtime.blocking`)."
    if doc:
        twin.__doc__ += f"\n\n{doc}"
    twin.__wrapped__ = fn  # type: ignore[attr-defined]  # typing.get_type_hints finds fn's names
    signature = inspect.signature(fn)
    annotations = dict(fn.__annotations__)
    if then is not None:
        signature = signature.replace(return_annotation=then)
        annotations["return"] = then
    twin.__signature__ = signature  # type: ignore[attr-defined]
    twin.__annotations__ = annotations
    return twin
