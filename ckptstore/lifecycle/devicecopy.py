"""Device staging: a save's pause is an on-device copy of the state, drained to the host later.

On an accelerator the copy of a state into device memory runs at the memory's speed, where
a copy to the host runs at the link's: on a TPU v5e about a hundred times slower
(docs/benchmarks.md, "On a TPU").
So a save may copy the state on its devices, return, and move the copy to the host in the
background while training goes on; each copied piece is freed on its device as soon as
its bytes are on the host (`DrainedPiece`).

- `DeviceCopier` copies each array with a compiled program, one per kind of array (shape,
  dtype, sharding), compiled once and kept; `warm` compiles them on a background thread,
  so that the first save need not pay for it.
- `device_room` says whether every device holding the state has room for a copy of its
  shards, from `Device.memory_stats` (the peak the training loop reached, with a margin).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ckptstore.datapath.arrays import sliced_shape
from ckptstore.runtime.hostpool import release_deferred

#: Room left on a device besides the copy: a share of its memory and a fixed amount, for
#: the allocator's fragmentation and what the next training step allocates beyond its peak.
MARGIN_SHARE = 0.05
MARGIN_BYTES = 256 << 20

Signature = tuple[tuple[int, ...], Any, jax.sharding.Sharding]  # shape, dtype, sharding


class DrainedPiece:
    """A piece of an on-device copy that the save owns; `np.asarray` of it moves it to the
    host and frees its device buffer at once (the write path converts each piece once).
    A second conversion is an error, not a silent read of freed memory."""

    def __init__(self, array: jax.Array) -> None:
        self._array: jax.Array | None = array
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.nbytes = int(array.nbytes)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        array = self._array
        if array is None:
            raise RuntimeError("this staged piece was already moved to the host and freed")
        self._array = None
        host = np.asarray(array)
        array.delete()  # the bytes are out: the device memory goes back to the loop
        # and the host copy is ours alone: JAX's own reference to it would otherwise
        # outlive the write until the next collection (`release_deferred`)
        release_deferred()
        return host if dtype is None else host.astype(dtype, copy=False)


class DeviceCopier:
    """On-device copies of arrays: one compiled program per kind of array (shape, dtype,
    sharding), kept, so that the leaves of a model that share a shape share a program
    (a transformer's layers: a few programs for thousands of leaves)."""

    def __init__(self) -> None:
        self._programs: dict[Signature, Future[Any]] = {}
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-compile")

    def close(self) -> None:
        self._compiler.shutdown(wait=True)
        self._programs.clear()

    def warm(self, arrays: Sequence[jax.Array]) -> None:
        """Compile the copies of ``arrays`` on a background thread, where not compiled yet."""
        for array in arrays:
            self._program(array)

    def copy(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
        """Copies of ``arrays`` on the same devices with the same shardings, done (on the
        devices) when this returns; all dispatched before any is waited for."""
        programs = [self._program(array) for array in arrays]
        out: list[jax.Array] = [
            program.result()(array) for program, array in zip(programs, arrays, strict=True)
        ]
        for copy in out:
            copy.block_until_ready()
        return out

    def _program(self, array: jax.Array) -> Future[Any]:
        key: Signature = (tuple(array.shape), array.dtype, array.sharding)
        with self._lock:
            program = self._programs.get(key)
            if program is None:
                program = self._programs[key] = self._compiler.submit(_compile, key)
        return program


def _compile(key: Signature) -> Any:
    shape, dtype, sharding = key
    aval = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # type: ignore[no-untyped-call]
    # `jnp.copy`, not the identity: jit forwards an input returned as it is, with no copy.
    return jax.jit(jnp.copy, out_shardings=sharding).lower(aval).compile()


def device_room(
    arrays: Sequence[jax.Array], earlier: dict[Any, int] | None = None
) -> tuple[bool | None, str]:
    """Whether each device holding ``arrays`` has room for a copy of its shards of them
    (None: a device does not say), and why, in words for `SaveStats.staging_reason`.

    The room is what is left below the device's limit above the peak the training loop
    reached, less a margin. ``earlier``: bytes per device of an earlier copy of this
    stager, which that peak may include and which is gone by now.
    """
    for device, nbytes in bytes_per_device(arrays).items():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None, f"{device} does not report its free memory"
        room = room_for_copy(stats, (earlier or {}).get(device, 0))
        if nbytes > room:
            return False, (
                f"{device} has {max(room, 0) >> 20} MiB free beyond its peak use and a "
                f"margin; a copy of its shards needs {nbytes >> 20} MiB"
            )
    return True, "every device has room for a copy of its shards"


def room_for_copy(stats: dict[str, Any], earlier: int = 0) -> int:
    """Bytes a copy may take on a device whose `Device.memory_stats` are ``stats``: its
    limit, less the peak use (less ``earlier``, an earlier copy that peak may include),
    less `MARGIN_SHARE` of the limit and `MARGIN_BYTES`."""
    limit = int(stats["bytes_limit"])
    peak = int(stats.get("peak_bytes_in_use", 0)) - earlier
    used = max(peak, int(stats.get("bytes_in_use", 0)))
    return limit - used - int(limit * MARGIN_SHARE) - MARGIN_BYTES


def bytes_per_device(arrays: Sequence[jax.Array]) -> dict[Any, int]:
    """How many bytes of ``arrays`` each addressable device holds (from the shardings:
    no array is made per shard, which costs ~150 us a leaf on 8 devices)."""
    out: dict[Any, int] = {}
    for array in arrays:
        for device, nbytes in _per_device(array.sharding, tuple(array.shape), array.dtype.itemsize):
            out[device] = out.get(device, 0) + nbytes
    return out


@functools.lru_cache(maxsize=4096)
def _per_device(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int
) -> tuple[tuple[Any, int], ...]:
    """Per addressable device, the bytes of its slice of an array of ``shape``."""
    out = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        out.append((device, itemsize * math.prod(sliced_shape(shape, index or ()))))
    return tuple(out)
