"""Blocking twins of the async API, for scripts and notebooks.

They run the coroutine on one private event-loop thread, so they work whether
or not the caller already runs an event loop, and backends opened for them
stay on one loop. Ctrl-C (or any exception raised in the waiting thread, such as
`KeyboardInterrupt`) cancels the running work and waits until it has stopped
before it propagates: nothing keeps writing behind the caller's back. A second
Ctrl-C while that cancellation runs stops waiting for it.

The twins of `ckptstore.promote`, `export_orbax` and `import_orbax` live beside
them (`lifecycle.tiers`, `importers`), as this layer must not import those.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from ckptstore.checkpoint.cleanup import Removal, delete_step, gc
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.checkpoint.partial import Part, PartialSave, partial_save
from ckptstore.checkpoint.save import SaveResult, save
from ckptstore.checkpoint.tiered import list_steps, read_manifest, restore, verify
from ckptstore.checkpoint.verify import VerifyReport
from ckptstore.leaves import LeafInfo

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ckptstore-loop", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on the background loop and return its result.

    Interrupted while waiting (Ctrl-C), it cancels ``coro`` and waits for it to
    finish unwinding before re-raising, so no write outlives the call.
    """
    loop = _background_loop()
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


def save_sync(*args: Any, **kwargs: Any) -> SaveResult:
    """`ckptstore.save`, blocking."""
    return run(save(*args, **kwargs))


def restore_sync(*args: Any, **kwargs: Any) -> Any:
    """`ckptstore.restore`, blocking."""
    return run(restore(*args, **kwargs))


def list_steps_sync(*args: Any, **kwargs: Any) -> list[int]:
    """`ckptstore.list_steps`, blocking."""
    return run(list_steps(*args, **kwargs))


def verify_sync(*args: Any, **kwargs: Any) -> VerifyReport:
    """`ckptstore.verify`, blocking."""
    return run(verify(*args, **kwargs))


def read_manifest_sync(*args: Any, **kwargs: Any) -> Manifest:
    """`ckptstore.read_manifest`, blocking."""
    return run(read_manifest(*args, **kwargs))


def delete_step_sync(*args: Any, **kwargs: Any) -> Removal:
    """`ckptstore.delete_step`, blocking."""
    return run(delete_step(*args, **kwargs))


def gc_sync(*args: Any, **kwargs: Any) -> Removal:
    """`ckptstore.gc`, blocking."""
    return run(gc(*args, **kwargs))


def partial_save_sync(*args: Any, **kwargs: Any) -> PartialSaveSync:
    """`ckptstore.partial_save`, blocking: a session whose methods block."""
    return PartialSaveSync(run(partial_save(*args, **kwargs)))


class PartialSaveSync:
    """A `PartialSave` session with blocking methods (``with`` closes it, as ``async with``
    closes the async one)."""

    def __init__(self, session: PartialSave):
        self.session = session

    @property
    def step(self) -> int:
        return self.session.step

    @property
    def attempt(self) -> str:
        """See `PartialSave.attempt`."""
        return self.session.attempt

    @property
    def parts(self) -> list[Part]:
        """The parts recorded so far."""
        return self.session.parts

    @property
    def leaves(self) -> dict[str, LeafInfo]:
        """See `PartialSave.leaves`."""
        return self.session.leaves

    def add(self, subtree: Any, *, replace: bool = False) -> Part:
        """`PartialSave.add`, blocking."""
        return run(self.session.add(subtree, replace=replace))

    def drop(self, index: int) -> None:
        """`PartialSave.drop`, blocking."""
        run(self.session.drop(index))

    def abandon(self) -> None:
        """`PartialSave.abandon`, blocking."""
        run(self.session.abandon())

    def finalize(self, **kwargs: Any) -> SaveResult:
        """`PartialSave.finalize`, blocking."""
        return run(self.session.finalize(**kwargs))

    def close(self) -> None:
        """`PartialSave.close`, blocking."""
        run(self.session.close())

    def __enter__(self) -> PartialSaveSync:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PartialSaveSync step {self.step} attempt {self.attempt}>"
