"""Device staging (`ckptstore.lifecycle.devicecopy`): on-device copies that a save drains to
the host piece by piece, the room check that chooses it, and its compile ahead of the first
save. On CPU devices here: the same code paths an accelerator runs."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.format.leaves import HostShards
from ckptstore.lifecycle import staging
from ckptstore.lifecycle.devicecopy import (
    MARGIN_BYTES,
    DeviceCopier,
    DrainedPiece,
    device_room,
    room_for_copy,
)
from ckptstore.lifecycle.staging import Stager

GiB = 1 << 30


def state() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    return {
        "w": jax.device_put(
            np.arange(64 * 32, dtype=np.float32).reshape(64, 32), NamedSharding(mesh, P("x", "y"))
        ),
        "r": jax.device_put(np.arange(16.0), NamedSharding(mesh, P())),
        "one": jax.numpy.ones(5, jax.numpy.int8),  # on one device: another program
        "key": jax.random.key(7),
        "host": np.arange(4),
        "n": 3,
    }


def test_device_staging_copies_each_array_where_it_lies_and_drains_each_piece_once() -> None:
    tree = state()
    stager = Stager()
    try:
        staged = stager.stage(tree, "device")
    finally:
        stager.close()
    assert staged.mode == "device" and staged.reason == "asked for"
    w = staged.tree["w"]
    assert isinstance(w, HostShards) and w.sharding == tree["w"].sharding
    assert len(w.pieces) == 8  # each device's own shard, replica 0
    assert staged.tree["key"].prng_impl is not None
    assert len(staged.tree["r"].pieces) == 1  # a replicated array: one piece written
    index, piece = w.pieces[3]
    assert isinstance(piece, DrainedPiece)
    for leaf in jax.tree.leaves(tree):  # the originals may go at once
        if isinstance(leaf, jax.Array):
            leaf.delete()
    want = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)[index]
    assert np.array_equal(np.asarray(piece), want)
    with pytest.raises(RuntimeError, match="already moved to the host"):
        np.asarray(piece)  # its device buffer is gone: never a read of freed memory


def test_the_copy_is_compiled_once_per_kind_of_array_and_ahead_of_the_first_save() -> None:
    tree = state()
    arrays = [tree["w"], tree["r"], tree["one"]]
    copier = DeviceCopier()
    try:
        copier.warm([*arrays, arrays[0] + 1])  # three kinds of array: three programs
        assert len(copier._programs) == 3
        copies = copier.copy(arrays)
        assert len(copier._programs) == 3  # the warm ones were used
        for copy, array in zip(copies, arrays, strict=True):
            assert copy.sharding == array.sharding
            assert np.array_equal(np.asarray(copy), np.asarray(array))
            for mine, theirs in zip(copy.addressable_shards, array.addressable_shards, strict=True):
                pointer = mine.data.unsafe_buffer_pointer()
                assert pointer != theirs.data.unsafe_buffer_pointer()  # a copy, not the array
    finally:
        copier.close()


def every_other_step(tmp_path: Any, staging: str) -> ckptstore.CheckpointManager:
    """A manager that saves even steps only: step 1 is a step it declines."""
    opts = ckptstore.ManagerOptions(staging=staging, handle_sigterm=False)  # type: ignore[arg-type]
    policy = ckptstore.policies.EveryNSteps(2)
    return ckptstore.CheckpointManager(str(tmp_path), save_policy=policy, options=opts)


def test_a_manager_compiles_the_device_copy_on_a_step_it_does_not_save(tmp_path: Any) -> None:
    with every_other_step(tmp_path, "device") as mgr:
        tree = state()
        assert mgr.save(1, tree) is None
        programs = mgr._stager._copier._programs
        assert len(programs) == 4  # w, r, one, the key's data
        handle = mgr.save(2, tree)
        assert handle is not None and handle.wait().staging_mode == "device"
        assert len(programs) == 4  # no compile in the save's pause
        restored = mgr.restore(2, like=tree)
        assert np.array_equal(np.asarray(restored["w"]), np.asarray(tree["w"]))


def test_a_manager_makes_the_host_buffers_on_a_step_it_does_not_save(tmp_path: Any) -> None:
    """Host staging's first save pays for fresh pages unless `warm` made them before; a
    configuration item beside the arrays is no array to stage (nor an error)."""
    config = {"lr": 0.1, "schedule": "cosine"}
    with every_other_step(tmp_path, "host") as mgr:
        tree = state()
        assert mgr.save(1, items={"state": tree, "config": config}) is None
        stager = mgr._stager
        assert stager._warming
        stager._warmed()
        made = {key: id(buf) for key, buf in stager._buffers.items()}
        arrays = [tree["w"], tree["r"], tree["one"], jax.random.key_data(tree["key"])]
        want = sum(int(a.nbytes) for a in arrays) + tree["host"].nbytes
        assert stager.held_bytes == want  # each array's own shards, once
        handle = mgr.save(2, items={"state": tree, "config": config})
        assert handle is not None and handle.wait().staging_mode == "host"
        assert {key: id(buf) for key, buf in stager._buffers.items()} == made  # reused
        restored = mgr.restore(2, like=tree)
        assert np.array_equal(np.asarray(restored["w"]), np.asarray(tree["w"]))
        assert mgr.restore(2, item="config") == config


def test_the_host_buffers_are_planned_before_the_loop_can_donate_the_arrays() -> None:
    """`warm` reads the arrays' shards on the caller's thread: a loop that donates them
    right after the step is declined must not fail its first save."""
    import threading

    stager = Stager(threads=1)
    try:
        busy, go = threading.Event(), threading.Event()
        stager._pool.submit(lambda: (busy.set(), go.wait()))  # the staging thread is busy
        busy.wait()
        tree = state()
        stager.warm(tree, "host")
        for leaf in jax.tree.leaves(tree):  # donated by the next step
            if isinstance(leaf, jax.Array):
                leaf.delete()
        go.set()
        staged = stager.stage(state(), "host")
    finally:
        stager.close()
    assert staged.mode == "host"
    index, piece = staged.tree["w"].pieces[0]
    assert np.array_equal(piece, np.asarray(state()["w"])[index])


def test_auto_stages_a_host_copy_on_cpu_devices_and_says_why(tmp_path: Any) -> None:
    """Never views (`test_aliasing.py`): an array on CPU devices may be a numpy buffer."""
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    with ckptstore.CheckpointManager(str(tmp_path), options=opts) as mgr:
        handle = mgr.save(1, state(), force=True)
        assert handle is not None
        stats = handle.wait()
    assert stats.staging_mode == "host"
    assert "CPU devices" in stats.staging_reason


def test_device_room_is_unknown_where_a_device_does_not_report_its_memory() -> None:
    room, why = device_room([state()["w"]])
    assert room is None and "does not report" in why


@pytest.mark.parametrize(
    ("peak", "earlier", "fits"),
    [
        (4 * GiB, 0, True),  # 16 GiB limit, 4 GiB peak: 4 GiB fits beside it
        (11 * GiB, 0, False),  # 11 GiB peak: 5 GiB left, less the margin
        (11 * GiB, 4 * GiB, True),  # the peak held the earlier copy: 9 GiB left
    ],
)
def test_a_copy_fits_below_the_peak_use_with_a_margin(peak: int, earlier: int, fits: bool) -> None:
    stats = {"bytes_limit": 16 * GiB, "peak_bytes_in_use": peak, "bytes_in_use": 2 * GiB}
    room = room_for_copy(stats, earlier)
    assert room == 16 * GiB - max(peak - earlier, 2 * GiB) - int(16 * GiB * 0.05) - MARGIN_BYTES
    assert (4 * GiB <= room) is fits


def test_bytes_per_device_are_each_devices_shards_without_making_them() -> None:
    from ckptstore.lifecycle.devicecopy import bytes_per_device

    tree = state()
    arrays = [tree["w"], tree["r"], tree["one"], jax.random.key_data(tree["key"])]
    want: dict[Any, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            want[shard.device] = want.get(shard.device, 0) + int(shard.data.nbytes)
    assert bytes_per_device(arrays) == want


def test_a_drained_piece_lets_jaxs_own_reference_to_its_host_copy_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a TPU, JAX keeps a reference to the host copy `np.asarray` made until the
    collector runs: a 4 GiB save held 4 GiB of host memory to its end. The drain runs
    `release_deferred` after each piece, which empties that queue."""
    import ckptstore.lifecycle.devicecopy as devicecopy

    released: list[int] = []
    monkeypatch.setattr(devicecopy, "release_deferred", lambda: released.append(1))
    piece = DrainedPiece(jax.numpy.arange(8.0))
    host = np.asarray(piece)
    assert released == [1] and np.array_equal(host, np.arange(8.0))


def test_warm_touches_every_page_of_its_buffers_in_slices_the_threads_share(
    monkeypatch: Any,
) -> None:
    """`warm` splits its buffers into slices for the staging threads: every byte in exactly
    one slice, each slice a view (touching it faults the buffer's own pages in)."""
    monkeypatch.setattr(staging, "TOUCH_SLICE", 3 * staging.PAGE)
    bufs = [np.ones(0, np.float32), np.ones(3, np.int8), np.ones((5, 2 * staging.PAGE), np.uint8)]
    parts = staging._slices(bufs)
    page = staging.PAGE
    assert [p.nbytes for p in parts] == [3, 3 * page, 3 * page, 3 * page, page]
    for part in parts:
        staging._touch(part)
    assert bufs[1][0] == 0 and (bufs[1][1:] == 1).all()
    flat = bufs[2].reshape(-1).view(np.uint8)
    assert (flat[:: staging.PAGE] == 0).all()
    assert (np.delete(flat, np.arange(0, flat.size, staging.PAGE)) == 1).all()


def test_host_staging_from_an_accelerator_keeps_each_transfers_own_host_array(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """From an accelerator (here: CPU devices taken for one), host staging makes no
    second copy of a device array into a staging buffer: each piece is the host array
    its transfer made, so the pause is the transfer's. Numpy leaves still go into
    reused buffers; the originals may be deleted as soon as staging returns."""
    monkeypatch.setattr(staging, "_on_cpu", lambda src: not isinstance(src, jax.Array))
    tree = state()
    want = {k: np.asarray(tree[k]) for k in ("w", "r", "one")}
    want["key"] = np.asarray(jax.random.key_data(tree["key"]))
    stager = Stager()
    try:
        staged = stager.stage(tree, "host")
        assert staged.mode == "host"
        assert set(stager._buffers) == {("host", ())}  # only the numpy leaf's
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        fetched = 0
        for name, whole in want.items():
            value = staged.tree[name]
            assert isinstance(value, HostShards)
            for index, piece in value.pieces:
                assert isinstance(piece, np.ndarray)
                assert np.array_equal(piece, whole[index])
                fetched += piece.nbytes
        assert fetched == sum(a.nbytes for a in want.values())  # replica 0 of each, once
        assert staged.copied == fetched + tree["host"].nbytes
    finally:
        stager.close()
