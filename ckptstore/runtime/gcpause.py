"""Pausing Python's cyclic garbage collector while a restore or save builds thousands of
objects.

A tree of thousands of leaves allocates tens of thousands of long-lived objects
(leaf records, arrays, shardings), and every so many of them the collector runs a
full collection that visits every object of the process: in a JAX process tens of
milliseconds each, several per restore of thousands of leaves (`docs/benchmarks.md`). None of
those objects is garbage. Reference counting frees memory as usual while paused;
only cycles wait, and the collector is back on (as it was) when the last pausing
operation of the process ends.

Saves do not pause it, except in their short synchronous steps that build an object
per leaf: describing the tree (before any I/O), and encoding or parsing the manifest and
the writers' pack records. A `CheckpointManager` save runs in the background while the
training loop goes on, and the loop's cycles would wait for as long as saves run.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # operations holding the pause, across threads and event loops
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the ``with`` block (nested and concurrent use nest)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
