"""What `CheckpointManager.save` returns: a `SaveHandle` to wait on (or await), whose
result is the save's `SaveStats`."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SaveStats:
    """Where one save's time went, in seconds, and what it wrote (this process)."""

    step: int
    attempt: str
    waited: float  # save() blocked on the previous save still in flight (if_busy="wait")
    staging: float  # copying the state (on the devices or to the host): with ``waited``, the pause
    write: float  # this process's shards to storage
    merge: float  # process 0; 0 elsewhere
    commit: float  # manifest and marker, process 0
    durable: float  # from the call to save() until the step was committed
    bytes: int  # payload of the whole step
    bytes_written: int  # by this process
    staged_bytes: int  # held for the save by this process: copies (device or host), or views
    #: Incremental saves (``ManagerOptions(incremental=True)``): payload bytes not written
    #: because ``base`` holds them, and the step the save referenced (None: a full save).
    bytes_referenced: int = 0
    base: int | None = None
    #: How the state was staged ("device", "host" or "view": `ckptstore.lifecycle.staging`)
    #: and why that way.
    staging_mode: str = "host"
    staging_reason: str = ""
    #: On tiers: the other steps committed on the fast tier that waited for the durable tier
    #: when this save committed: their promotion deferred (it did not answer:
    #: `CheckpointManager.unpromoted`) or not ended yet (a slow or silent durable tier).
    unpromoted: tuple[int, ...] = ()


class SaveHandle:
    """A save that has been staged; `wait` (or ``await``) until it is committed."""

    def __init__(self, step: int, future: concurrent.futures.Future[SaveStats]) -> None:
        self.step = step
        self._future = future
        self.observed = False  # whether someone saw its outcome (then the next save won't)

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the step is committed; raises whatever the save raised."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                self.observed = True

    def __await__(self) -> Generator[Any, None, SaveStats]:
        self.observed = True
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SaveHandle step {self.step} {state}>"
