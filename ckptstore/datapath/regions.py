"""Regions of a piece on the host, without the whole piece.

A piece in host memory (numpy, a staged copy, or a jax array on CPU devices, viewed in place)
is read in place. A piece on an accelerator would be copied to the host whole by
`np.asarray`: for a declared-rows save (`ckptstore.checkpoint.declared`) of a 256 MiB
table on a TPU v5e, 256 MiB over a 2.9 GB/s link (~90 ms, and a host copy of the table) to
read the 20 MiB its declared rows lie in. There each region is sliced on the device (one
gather per region shape, their starts a run-time argument) and only they are copied.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ckptstore.format.leaves import Index


def read_regions(data: Any, regions: Sequence[Index]) -> list[np.ndarray[Any, Any]]:
    """``regions`` (step-1 slices relative to the piece ``data``) as numpy arrays: views of
    it where it is in host memory; where it is a jax array on an accelerator, the regions
    of each shape gathered on the device `BATCH` at a time and copied to the host together
    (a call per region took 0.5 ms each on a TPU v5e: 40 of them a third of the whole
    piece's copy)."""
    if not (isinstance(data, jax.Array) and on_accelerator(data)):
        host = data if isinstance(data, np.ndarray) else np.asarray(data)  # a view on CPU
        return [host[region] for region in regions]
    bounds = [[r.indices(n)[:2] for r, n in zip(reg, data.shape, strict=True)] for reg in regions]
    starts = [tuple(a for a, _ in b) for b in bounds]
    sizes = [tuple(z - a for a, z in b) for b in bounds]
    by_size: dict[tuple[int, ...], list[int]] = {}
    for k, size in enumerate(sizes):
        by_size.setdefault(size, []).append(k)
    out: dict[int, np.ndarray[Any, Any]] = {}
    for size, which in by_size.items():
        out.update(zip(which, _gather(data, [starts[k] for k in which], size), strict=True))
    return [out[k] for k in range(len(regions))]


def on_accelerator(data: jax.Array) -> bool:
    """Whether ``data`` lives outside host memory (any device not a CPU)."""
    return any(d.platform != "cpu" for d in data.devices())


#: Regions per device call: a fixed count, so one compiled gather serves a region shape
#: whatever the number of regions (a call per count compiled again for every new count,
#: 0.15-0.6 s each on a TPU v5e), at most ``BATCH - 1`` regions copied in vain.
BATCH = 8


def _gather(
    data: jax.Array, starts: Sequence[tuple[int, ...]], size: tuple[int, ...]
) -> list[np.ndarray[Any, Any]]:
    """The regions of shape ``size`` at ``starts``: `BATCH` per device call (the last call's
    count made up with its last start), every call issued and its copy to the host started
    before the first is waited for."""
    gather = _gatherer(size)
    calls = []
    for first in range(0, len(starts), BATCH):
        some = list(starts[first : first + BATCH])
        some += [some[-1]] * (BATCH - len(some))
        calls.append(gather(data, np.array(some, np.int32)))
    for call in calls:
        call.copy_to_host_async()
    stacked = [np.asarray(call) for call in calls]
    return [stacked[k // BATCH][k % BATCH] for k in range(len(starts))]


@functools.lru_cache(maxsize=64)
def _gatherer(size: tuple[int, ...]) -> Callable[..., jax.Array]:
    """Regions of ``size`` at an array of starts, stacked (compiled once per piece shape)."""

    def gather(x: jax.Array, starts: jax.Array) -> jax.Array:
        return jax.vmap(lambda at: jax.lax.dynamic_slice(x, tuple(at), size))(starts)

    return jax.jit(gather)
