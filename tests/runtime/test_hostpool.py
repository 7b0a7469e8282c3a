"""`ckptstore.runtime.hostpool`: aligned host buffers, reused within a `pooled` block only
once nothing refers to them."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

import ckptstore
from ckptstore.runtime.hostpool import (
    ALIGNMENT,
    HostPool,
    aligned_empty,
    pooled,
    release_deferred,
)

MiB = 1 << 20


def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone() -> None:
    pool = HostPool(64 * MiB)
    first = pool.take(MiB)
    assert first.ctypes.data % ALIGNMENT == 0 and first.size == MiB
    view = first[16:].view(np.uint32)[:5].reshape(5, 1)  # a view of a view: still its buffer
    address = first.ctypes.data
    del first
    second = pool.take(MiB)
    assert second.ctypes.data != address  # the view still refers to the first buffer
    del view
    third = pool.take(MiB)
    assert third.ctypes.data == address and pool.reused == 1


def test_a_pool_keeps_no_more_than_its_bound() -> None:
    pool = HostPool(3 * MiB)
    held = [pool.take(MiB) for _ in range(5)]  # all in use: two beyond the bound
    assert pool.kept <= 3 * MiB
    assert len({b.ctypes.data for b in held}) == 5
    del held
    again = [pool.take(MiB) for _ in range(2)]
    assert pool.reused == 2 and len(again) == 2


def test_aligned_empty_takes_from_the_running_pool_only() -> None:
    with pooled(8 * MiB) as pool:
        a = aligned_empty((256, 1024), np.dtype(np.float32))
        assert pool.taken == 1 and a.shape == (256, 1024) and a.flags.writeable
    b = aligned_empty((16,), np.dtype(np.float64))
    assert pool.taken == 1 and b.ctypes.data % ALIGNMENT == 0


def test_a_restore_in_a_pooled_block_reads_the_same_values(tmp_path: Path) -> None:
    tree = {f"l{i}": np.random.default_rng(i).standard_normal((512, 300)) for i in range(6)}
    ckptstore.save_sync(str(tmp_path), tree, step=1)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
    with pooled(4 * MiB) as pool:  # smaller than the tree: buffers are reused or made fresh
        for _ in range(2):
            got = asyncio.run(ckptstore.restore(str(tmp_path), 1, like=like))
            for k, v in tree.items():
                assert np.array_equal(np.asarray(got[k]), v), k
            del got
    assert pool.taken > 0


class _Holder:
    """Holds a buffer in a reference cycle, as JAX's runtime holds a host array a transfer
    is done with: let go only when the collector runs (jax-ml/jax#14882)."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.me = buffer, self


def test_a_buffer_held_until_the_next_collection_is_reused_after_one(
    no_collector: None,
) -> None:
    pool = HostPool(64 * MiB)
    first = pool.take(MiB)
    address = first.ctypes.data
    _Holder(first)  # the cycle is garbage now, but nothing collects it by itself
    del first
    second = pool.take(MiB)  # none free without a collection: the pool runs one
    assert second.ctypes.data == address and pool.reused == 1


def test_release_deferred_runs_the_collectors_callbacks(no_collector: None) -> None:
    """JAX empties its queue of released host arrays in a `gc.callbacks` hook."""
    ran: list[str] = []

    def hook(phase: str, info: dict[str, int]) -> None:
        ran.append(phase)

    gc.callbacks.append(hook)
    try:
        release_deferred()
    finally:
        gc.callbacks.remove(hook)
    assert ran == ["start", "stop"]


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The automatic collector off, as a training loop may run (and as this file's
    cycles need: an automatic collection would free them first)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
