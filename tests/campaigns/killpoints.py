"""Where tests kill the processes they start: the first bytes of a write (scripts that
tests run in a subprocess), and the torture campaign's exact points (`STOPS`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import tensorstore as ts


async def first_bytes(store: dict[str, Any], context: ts.Context, *_: Any) -> None:
    """Wait until the OCDBT store being written (``write_leaves``'s first two arguments)
    has its first object on storage, so a kill lands mid-write."""
    base = await ts.KvStore.open(store["base"], context=context)
    for _ in range(2000):
        if await base.list():
            return
        await asyncio.sleep(0.005)
    raise SystemExit("the write never started")


#: Exact kill points of the torture campaign (tests/campaigns/torture.py): name -> (module,
#: function, edge). A worker told to stop at one reports ``(process, "stop", name, ...)``
#: at that edge of the function and SIGSTOPs itself; the driver's SIGKILL then lands
#: exactly there (a stopped process dies of SIGKILL like a running one). The functions are
#: looked up as module globals by their callers (or as a class's methods: "Attempt.claim"),
#: so replacing them is enough.
STOPS: dict[str, tuple[str, str, str]] = {
    # an incremental save (S, base B): docs/incremental.md, "Safety"
    "base-read": ("ckptstore.checkpoint.incremental", "open_base", "end"),  # nothing written
    "agreed": ("ckptstore.checkpoint.save", "unchanged", "end"),  # after the agreement round
    "written": ("ckptstore.protocol.attempt", "Attempt.claim", "start"),  # shards written
    "merged": ("ckptstore.checkpoint.saveplan", "merge", "end"),  # merged, no manifest
    "manifest": ("ckptstore.protocol.attempt", "check_base", "start"),  # s1 done, not s2
    "base-checked": ("ckptstore.protocol.attempt", "check_base", "end"),  # before the marker
    # delete_step of a step others reference (D): d1, d2
    "delete-marked": ("ckptstore.checkpoint.cleanup", "mark_deleted", "end"),
    "delete-scanned": ("ckptstore.checkpoint.cleanup", "referenced_elsewhere", "end"),
    # gc (G): after reading what is referenced, before collecting
    "gc-scanned": ("ckptstore.checkpoint.cleanup", "_referenced", "end"),
}
#: The exact points inside an incremental save, and inside a deletion of a referenced step.
SAVE_STOPS = ["base-read", "agreed", "written", "merged", "manifest", "base-checked"]
DELETE_STOPS = ["delete-marked", "delete-scanned"]


def install_stop(name: str, report: Callable[[str], None]) -> None:
    """Make this process stop (SIGSTOP) at exact point ``name`` of `STOPS`, the first time
    it gets there, after ``report(name)``."""
    import importlib
    import os
    import signal

    module_name, path, edge = STOPS[name]
    module: Any = importlib.import_module(module_name)
    *owners, attr = path.split(".")  # "Attempt.claim": a method of a class of the module
    for owner in owners:
        module = getattr(module, owner)
    real: Callable[..., Awaitable[Any]] = getattr(module, attr)
    done = False

    def stop() -> None:
        nonlocal done
        if not done:
            done = True
            report(name)
            os.kill(os.getpid(), signal.SIGSTOP)

    async def stopping(*args: Any, **kwargs: Any) -> Any:
        if edge == "start":
            stop()
        result = await real(*args, **kwargs)
        if edge == "end":
            stop()
        return result

    setattr(module, attr, stopping)
