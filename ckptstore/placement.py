"""Handing restored host data to devices: few calls, no needless copies, off the loop.

Two costs dominate once the bytes are read. Each `jax.device_put` call carries a
fixed cost of a fraction of a millisecond, paid per leaf and per device, which is
most of a restore of thousands of small leaves; so many leaves go in one call. On
CPU devices JAX adopts a host buffer without copying it when the buffer is writable
and 64-byte aligned (every device of a replicated leaf then shares it), and copies
any other buffer at a fraction of memcpy speed; so data read into immutable bytes
is copied once, fast, into an aligned buffer of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ckptstore.chunks import ALIGNMENT, aligned_empty
from ckptstore.futures import off_loop


def adoptable(data: np.ndarray[Any, Any]) -> bool:
    """Whether a CPU device can use ``data``'s buffer as it is."""
    return (
        data.flags.writeable
        and data.flags.c_contiguous
        and data.ctypes.data % ALIGNMENT == 0
        and data.dtype.isnative
    )


def for_host_devices(data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``data`` in a buffer CPU devices adopt without copying (a copy only if needed).

    The caller hands the result to the devices and keeps no other use of it.
    """
    if data.size == 0 or adoptable(data):
        return data
    out = aligned_empty(data.shape, data.dtype)
    np.copyto(out, data)
    return out


def on_host(devices: Sequence[Any]) -> bool:
    return all(d.platform == "cpu" for d in devices)


async def put_slice(data: np.ndarray[Any, Any], devices: Sequence[Any]) -> list[jax.Array]:
    """One host slice onto each of ``devices`` (the ones holding that slice)."""

    def put() -> list[jax.Array]:
        host = for_host_devices(data) if on_host(devices) else data
        placed: list[jax.Array] = jax.device_put([host] * len(devices), list(devices))
        return placed

    return await off_loop(put, data.nbytes)


async def put_many(
    values: Sequence[np.ndarray[Any, Any]], shardings: Sequence[jax.sharding.Sharding]
) -> list[jax.Array]:
    """Whole host arrays laid out by ``shardings``, in one `jax.device_put` call."""

    def put() -> list[jax.Array]:
        placed: list[jax.Array] = jax.device_put(list(values), list(shardings))
        return placed

    return await off_loop(put, sum(v.nbytes for v in values))
