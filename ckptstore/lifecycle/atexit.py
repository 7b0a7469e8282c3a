"""No save is dropped at interpreter exit.

A script that returns from its training loop without ``with``, `close` or
`wait_until_finished` still has its last save in flight on the background loop, a daemon
thread that dies with the interpreter. Every open `CheckpointManager` is tracked here,
weakly; at exit each one's unfinished work is waited for (bounded by the manager's own
timeout) or, where it cannot finish, reported on stderr with its step. The wait runs
before Python stops its thread pools, which the save still needs (`threading`'s own exit
hooks run first, then `atexit`'s).
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import Protocol


class Finishes(Protocol):
    def finish_at_exit(self) -> str | None:
        """Finish what is in flight; what could not be finished, or None."""


_open: weakref.WeakSet[Finishes] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(manager: Finishes) -> None:
    """Finish ``manager``'s work at exit unless `untrack` is called first (its `close`)."""
    global _registered
    with _lock:
        _open.add(manager)
        if not _registered:
            # Before concurrent.futures refuses new work at shutdown; atexit is too late.
            register = getattr(threading, "_register_atexit", atexit.register)
            register(finish_all)
            _registered = True


def untrack(manager: Finishes) -> None:
    with _lock:
        _open.discard(manager)


def finish_all() -> None:
    """Finish every tracked manager's work; report on stderr what could not be."""
    with _lock:
        managers = list(_open)
    for manager in managers:
        problem = manager.finish_at_exit()
        if problem is not None:
            print(f"ckptstore: {problem}", file=sys.stderr, flush=True)
