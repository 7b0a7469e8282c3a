"""Host buffers for the data path: aligned, and within a restore onto accelerators, reused.

`aligned_empty` is where the data path gets host memory for bytes it reads: a buffer whose
data starts on an `ALIGNMENT` boundary (CPU devices adopt such a buffer without a copy).

Fresh host memory is expensive: every new page is faulted in and zeroed by the kernel,
which on an accelerator host can cost more than the read itself (a TPU v5e host read files
into reused buffers about four times as fast as into new memory: docs/benchmarks.md, "On a
TPU"). So a restore onto
accelerators runs `pooled`: while it runs, `aligned_empty` hands out buffers of a
`HostPool` that are free again, and makes new ones only while none is.

A pool buffer is free when nothing but the pool refers to it: every array made from it (a
slice, a view as another dtype, a chunk decoded in place, an array a device transfer still
holds) refers to it, through numpy's ``base``, until it is gone. So a buffer is never
handed out while anything can still read or write it, and nobody has to give one back.
Not for CPU devices: they adopt the host buffers as their own, which then never free up.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np

#: Host buffers start on this boundary (bytes): CPU devices adopt such buffers as they are.
ALIGNMENT = 64

_BYTE = np.dtype(np.uint8)


class HostPool:
    """Reused host buffers, keeping up to ``max_bytes`` of them; beyond that, buffers
    are made fresh and not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._raws: list[np.ndarray[Any, Any]] = []  # the buffers' owners (unaligned)
        self._lock = threading.Lock()
        self.kept = 0  # bytes kept
        self.taken = 0  # buffers handed out
        self.reused = 0  # of which reused

    def take(self, nbytes: int) -> np.ndarray[Any, Any]:
        """An aligned uint8 buffer of ``nbytes`` that nothing else refers to."""
        with self._lock:
            self.taken += 1
            fits = [raw for raw in self._raws if nbytes <= raw.size - ALIGNMENT <= 2 * nbytes]
            free = _unreferenced(fits)
            if free is None and fits:
                release_deferred()  # a transfer done with one may not have said so yet
                free = _unreferenced(fits)
            if free is not None:
                self.reused += 1
                return _aligned(free, nbytes)
            raw = np.empty(nbytes + ALIGNMENT, _BYTE)
            if self.kept + raw.size <= self.max_bytes:
                self._raws.append(raw)
                self.kept += raw.size
            return _aligned(raw, nbytes)


def _unreferenced(raws: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any] | None:
    """The first of ``raws`` (pool buffers) nothing outside the pool refers to."""
    for raw in raws:
        # Four references while free: the pool's list, ``raws``, ``raw`` and
        # getrefcount's argument.
        if sys.getrefcount(raw) == 4:
            return raw
    return None


def release_deferred() -> None:
    """Let the host arrays go that JAX's runtime is done with but still holds.

    The runtime drops its references to host arrays from its own threads (the end of a
    transfer to or from a device) by queueing them, and the queue is emptied when the
    garbage collector runs (jax-ml/jax#14882). Until then a drained device copy's host bytes,
    or a pool buffer a device transfer has finished reading, stay allocated: on a TPU a
    device-staged save of 4 GiB held all 4 GiB until the next full collection. A
    young-generation collection empties the queue at the cost of a few microseconds.
    """
    gc.collect(0)


_POOL: ContextVar[HostPool | None] = ContextVar("ckptstore_host_pool", default=None)


@contextlib.contextmanager
def pooled(max_bytes: int) -> Iterator[HostPool]:
    """Within this block (and the tasks and threads started in it that copy its context),
    `aligned_empty` reuses the buffers of one `HostPool` of up to ``max_bytes``."""
    pool = HostPool(max_bytes)
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)


def aligned_empty(shape: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """An uninitialized writable array whose data starts on an `ALIGNMENT` boundary; from
    the pool of the running `pooled` block, if any."""
    nbytes = math.prod(shape) * dtype.itemsize
    pool = _POOL.get()
    buf = (
        pool.take(nbytes)
        if pool is not None
        else _aligned(np.empty(nbytes + ALIGNMENT, _BYTE), nbytes)
    )
    return buf.view(dtype).reshape(tuple(shape))


def _aligned(raw: np.ndarray[Any, Any], nbytes: int) -> np.ndarray[Any, Any]:
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes]
