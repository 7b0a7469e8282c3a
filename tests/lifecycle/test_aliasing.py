"""A `jax.Array` that shares its memory with a numpy buffer (on CPU devices
`jax.device_put` of a 64-byte-aligned numpy array does not copy): changing the buffer in
place changes the array, so neither the incremental shortcut (the very object saved
before) nor the default staging may trust it (docs/manager.md, "Staging")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import ckptstore
from ckptstore.datapath.arrays import may_share_host_memory
from tests.lifecycle.helpers import options

N = 1 << 18  # 1 MiB of float32


def aliased(values: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], jax.Array]:
    """A numpy buffer holding ``values`` and a jax array on the CPU device that is it."""
    raw = np.zeros(values.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    buf = raw[start : start + values.nbytes].view(values.dtype)
    buf[:] = values
    array = jax.device_put(buf, jax.devices("cpu")[0])
    # The premise: without it these tests would prove nothing.
    assert array.unsafe_buffer_pointer() == buf.ctypes.data, "device_put copied"
    return buf, array


@pytest.mark.parametrize("staging", ["auto", "host", "view", "device"])
def test_an_incremental_save_of_the_same_aliased_array_digests_it(
    tmp_path: Path, staging: str
) -> None:
    root = str(tmp_path / "run")
    buf, x = aliased(np.arange(N, dtype=np.float32))
    opts = options(staging=staging)
    with ckptstore.CheckpointManager(root, options=opts) as mgr:
        mgr.save(1, {"x": x})
        mgr.wait_until_finished()
        buf[::2] = -1.0  # the same object `x`, other values
        mgr.save(2, {"x": x})
        mgr.wait_until_finished()
        second = mgr.stats[-1]
    restored = ckptstore.restore_sync(root, 2)
    np.testing.assert_array_equal(np.asarray(restored["x"]), buf)
    assert second.bytes_referenced == 0  # nothing of step 1 holds these values


def test_the_default_staging_copies_an_aliased_array_before_save_returns(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    at_call = np.arange(4 * N, dtype=np.float32)
    buf, x = aliased(at_call)
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        handle = mgr.save(1, {"x": x})
        buf[:] = -1.0  # as docs/manager.md allows once `save` returned
        assert handle is not None
        stats = handle.wait()
    np.testing.assert_array_equal(np.asarray(ckptstore.restore_sync(root, 1)["x"]), at_call)
    assert stats.staging_mode == "host"


def test_host_memory_arrays_may_share_and_a_computation_output_is_judged_the_same() -> None:
    _, x = aliased(np.ones(16, np.float32))
    assert may_share_host_memory(x)
    assert may_share_host_memory(x + 1)  # nothing in JAX tells them apart
