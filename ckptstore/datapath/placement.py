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

from ckptstore.runtime.futures import off_loop
from ckptstore.runtime.hostpool import ALIGNMENT, aligned_empty


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
    """Whole host arrays laid out by ``shardings``: replicated ones each with one call to
    JAX's transfer (`put_replicated`), the others in one `jax.device_put` call."""

    def put() -> list[jax.Array]:
        pairs = zip(values, shardings, strict=True)
        out: list[jax.Array | None] = [put_replicated(v, s) for v, s in pairs]
        rest = [k for k, placed in enumerate(out) if placed is None]
        if rest:
            more = jax.device_put([values[k] for k in rest], [shardings[k] for k in rest])
            for k, placed in zip(rest, more, strict=True):
                out[k] = placed
        return [placed for placed in out if placed is not None]

    return await off_loop(put, sum(v.nbytes for v in values))


def put_replicated(value: np.ndarray[Any, Any], sharding: jax.sharding.Sharding) -> Any:
    """``value`` on every device of ``sharding`` when it is replicated over this process's
    devices, else None.

    `jax.device_put` spends about half of its ~45 us per array in Python layers (tree
    handling, abstract values with shardings) before JAX's own transfer; with thousands
    of small leaves that is a tenth of a restore. This calls the transfer itself
    (`jax._src`, like ckptstore's use of `jax._src.distributed`: JAX is pinned below its
    next minor release), and returns None wherever that entry point is missing.
    """
    devices = getattr(sharding, "_addressable_device_assignment", None)
    if _device_put is None or devices is None or not sharding.is_fully_replicated:
        return None
    if not sharding.is_fully_addressable or value.dtype.kind not in _KINDS:
        return None
    aval = _core.ShapedArray(value.shape, value.dtype)
    return _device_put(aval, sharding, [value] * len(devices), list(devices))


_KINDS = "biufc"  # booleans and numbers: what `jax.device_put` hands through unchanged
try:
    from jax._src import core as _core
    from jax._src.interpreters.pxla import batched_device_put as _device_put
except ImportError:  # another JAX: `jax.device_put` does it all
    _device_put = None  # type: ignore[assignment]
