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

import functools
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
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


#: A slice larger than this reaches an accelerator in pieces of about this size (whole
#: stored chunks each where a chunk is smaller), each through the restore's reused host
#: buffers, assembled on the device (`Assembly`): host memory stays the pool's size
#: whatever the leaf's (a 1 GiB leaf read whole took 3 GiB of fresh host memory).
PIECE_BYTES = 64 << 20


def piece_plan(
    shape: Sequence[int], itemsize: int, chunk_shape: Sequence[int]
) -> tuple[int, int] | None:
    """How to split a slice of ``shape`` into pieces: (axis, extent of each piece along
    it), or None where it is no larger than `PIECE_BYTES` or cannot be split. The axis is
    the first longer than 1; the extent a multiple of the stored chunks' where a piece
    holds a chunk or more, so that no chunk is read twice."""
    nbytes = math.prod(shape) * itemsize
    axis = next((a for a, n in enumerate(shape) if n > 1), None)
    if nbytes <= PIECE_BYTES or axis is None:
        return None
    per = nbytes // shape[axis]  # bytes of one index along the axis
    rows = max(1, PIECE_BYTES // per)
    chunk = chunk_shape[axis] if axis < len(chunk_shape) else 1
    if rows >= chunk:
        rows = rows // chunk * chunk
    return (axis, rows) if rows < shape[axis] else None


def piece_starts(extent: int, rows: int) -> list[int]:
    """Where each piece starts along the split axis; the last one ends at ``extent`` and may
    overlap the one before (it rewrites equal values), so that every piece has one shape
    and the device program that places them compiles once."""
    return [*range(0, extent - rows, rows), extent - rows]


class Assembly:
    """One slice built on each of ``devices`` from pieces along ``axis``: a buffer of the
    slice's shape per device, each piece transferred and written into it at its offset by
    a compiled ``dynamic_update_slice`` that donates the buffer (so the device holds the
    slice plus the pieces in flight, never two copies of the slice)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        axis: int,
        rows: int,
        devices: Sequence[Any],
    ) -> None:
        self.shape, self.dtype, self.axis, self.devices = shape, dtype, axis, list(devices)
        self.piece_shape = tuple(rows if a == axis else n for a, n in enumerate(shape))
        self._lock = threading.Lock()  # one update of a buffer at a time
        self._buffers: list[jax.Array] | None = None

    async def add(self, start: int, data: np.ndarray[Any, Any]) -> None:
        """Place the piece ``data`` (of `piece_shape`) at ``start`` along the axis."""
        if data.shape != self.piece_shape:
            raise ValueError(f"a piece of shape {data.shape}, not {self.piece_shape}")

        def put() -> None:
            placed = jax.device_put([data] * len(self.devices), self.devices)
            with self._lock:
                if self._buffers is None:
                    self._buffers = [_zeros(self.shape, self.dtype, d) for d in self.devices]
                self._buffers = [
                    _updater(self.shape, self.piece_shape, self.dtype, self.axis, d)(
                        buf, piece, jax.device_put(np.int32(start), d)
                    )
                    for buf, piece, d in zip(self._buffers, placed, self.devices, strict=True)
                ]

        await off_loop(put, data.nbytes)

    def arrays(self) -> list[jax.Array]:
        """The slice on each device, once every piece is placed."""
        if self._buffers is None:
            raise ValueError("no piece was placed")
        return self._buffers


def _zeros(shape: tuple[int, ...], dtype: np.dtype[Any], device: Any) -> jax.Array:
    return jnp.zeros(shape, dtype, device=device)


@functools.lru_cache(maxsize=64)
def _updater(
    shape: tuple[int, ...],
    piece_shape: tuple[int, ...],
    dtype: np.dtype[Any],
    axis: int,
    device: Any,
) -> Any:
    """The compiled program writing a piece into a slice's buffer on ``device`` at a start
    given at run time (one program per shapes, dtype and device, kept)."""
    on = jax.sharding.SingleDeviceSharding(device)

    def update(buf: jax.Array, piece: jax.Array, start: jax.Array) -> jax.Array:
        starts = tuple(start if a == axis else 0 for a in range(len(shape)))
        return jax.lax.dynamic_update_slice(buf, piece, starts)

    avals = (
        jax.ShapeDtypeStruct(shape, dtype, sharding=on),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct(piece_shape, dtype, sharding=on),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((), np.int32, sharding=on),  # type: ignore[no-untyped-call]
    )
    return jax.jit(update, donate_argnums=0).lower(*avals).compile()
