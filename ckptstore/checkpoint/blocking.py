"""Blocking twins of the async API, for scripts and notebooks.

They run the coroutine on one private event-loop thread, so they work whether
or not the caller already runs an event loop, and backends opened for them
stay on one loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptstore.checkpoint.save import SaveResult, save
from ckptstore.checkpoint.tiered import list_steps, restore, verify
from ckptstore.checkpoint.verify import VerifyReport

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on the background loop and return its result."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ckptstore-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop).result()


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
