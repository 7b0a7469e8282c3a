"""Pausing Python's cyclic garbage collector while a restore or save builds thousands of
objects.

A tree of thousands of leaves allocates tens of thousands of long-lived objects
(leaf records, arrays, shardings), and every so many of them the collector runs a
full collection that visits every object of the process: in a JAX process about
70 ms each, two or three per 5,000-leaf restore (`docs/benchmarks.md`). None of
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
_keep = False  # a pause of this window asked for `_promote_survivors`


@contextlib.contextmanager
def gc_paused(*, keep_survivors: bool = False) -> Iterator[None]:
    """The cyclic collector off for the ``with`` block (nested and concurrent use nest).

    ``keep_survivors`` (a restore's pause): when the last pause ends, what was made during
    it and is still alive goes to the oldest generation unvisited (`_promote_survivors`).
    Saves do not ask for it: they end while a training loop runs, whose young objects it
    would move too."""
    global _depth, _was_enabled, _keep
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
        _keep = _keep or keep_survivors
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _keep and _was_enabled:
                    _promote_survivors()
                _keep = False
                if _was_enabled:
                    gc.enable()


def _promote_survivors() -> None:
    """Move every object the collector tracks to the oldest generation without visiting it.

    Objects made while paused and still alive at its end are the long-lived ones (a
    restored tree's arrays, a manifest's records), yet the collector counts them all as
    new: its first collection once re-enabled would visit every one (~13 ms after a
    5,000-leaf restore, on the caller's time). ``freeze`` then ``unfreeze`` hands them to
    the oldest generation, whose own collections come as rarely as usual, and resets the
    count; cycles among them are still collected, by the next full collection. Skipped
    when something else froze objects: those stay frozen."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
