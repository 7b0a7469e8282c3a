"""Free space on the fast tier, checked before a save: promoted steps make room (oldest first,
only as many as needed), else the save fails early with `InsufficientSpaceError` and writes
nothing. The disk is real; only its size is made small: `SmallDisk` is a `LocalBackend` whose
free space is a fixed capacity minus what its files really take."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckptstore
from ckptstore.backends import supports
from ckptstore.backends.local import LocalBackend
from ckptstore.format import layout
from ckptstore.protocol import Marker
from ckptstore.tiers.hostlocal import Staged
from ckptstore.tiers.room import Room, ensure_room, promoted_steps
from tests.tiers.helpers import STEP_BYTES, SmallDisk, assert_tree, tiers_on, tree


async def test_promoted_steps_make_room_oldest_first(tmp_path: Path) -> None:
    tiers = tiers_on(tmp_path, capacity=int(3.5 * STEP_BYTES))
    for step in (1, 2):
        await ckptstore.save(tiers, tree(step), step=step)
    await ckptstore.promote(tiers)  # 1 and 2 are durable now, both still on the fast tier
    await ckptstore.save(tiers, tree(3), step=3)
    assert await ckptstore.list_steps(tiers.fast) == [1, 2, 3]  # there was room: no eviction
    await ckptstore.save(tiers, tree(4), step=4)  # evicts 1 only: that makes room
    assert await ckptstore.list_steps(tiers.fast) == [2, 3, 4]
    assert await ckptstore.list_steps(tiers) == [1, 2, 3, 4]
    assert_tree(await ckptstore.restore(tiers, step=1), 1)  # from the durable tier


async def test_no_room_fails_early_and_writes_nothing(tmp_path: Path) -> None:
    tiers = tiers_on(tmp_path, capacity=int(2.5 * STEP_BYTES))
    await ckptstore.save(tiers, tree(1), step=1)
    await ckptstore.save(tiers, tree(2), step=2)  # neither promoted: nothing may go
    with pytest.raises(ckptstore.InsufficientSpaceError) as caught:
        await ckptstore.save(tiers, tree(3), step=3)
    err = caught.value
    assert str(tmp_path / "nvme") in str(err) and "no promoted step" in str(err)
    assert err.needed == STEP_BYTES + 4096 and 0 <= err.free < err.needed
    assert not (tmp_path / "nvme" / "3").exists()  # refused before writing anything
    assert await ckptstore.list_steps(tiers.fast) == [1, 2]


async def test_when_eviction_cannot_help_nothing_is_evicted(tmp_path: Path) -> None:
    tiers = tiers_on(tmp_path, capacity=int(2.5 * STEP_BYTES))
    await ckptstore.save(tiers, tree(1), step=1)
    await ckptstore.promote(tiers)
    await ckptstore.save(tiers, tree(2), step=2)
    big = {"w": tree(3)["w"].repeat(4, axis=0)}  # 4x a step: more than the whole disk
    with pytest.raises(ckptstore.InsufficientSpaceError, match=r"after evicting every promoted"):
        await ckptstore.save(tiers, big, step=3)
    assert await ckptstore.list_steps(tiers.fast) == [1, 2]  # step 1 was not evicted for nothing


async def test_the_real_free_space_is_checked(tmp_path: Path) -> None:
    """Through statvfs on the real filesystem: a margin bigger than the disk's free space."""
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    tiers = ckptstore.Tiered(str(tmp_path / "nvme"), str(tmp_path / "bucket"), free_margin=free)
    with pytest.raises(ckptstore.InsufficientSpaceError, match="fast tier") as caught:
        await ckptstore.save(tiers, tree(1), step=1)
    assert caught.value.needed == free + STEP_BYTES
    assert abs(caught.value.free - free) < free // 10  # what statvfs said (other writers aside)
    assert not (tmp_path / "nvme").exists()
    assert await LocalBackend(tmp_path / "nvme").free_bytes() == pytest.approx(free, rel=0.1)
    assert await supports.free_bytes(ckptstore.open_backend("memory://room")) is None


def test_the_manager_checks_room_too(tmp_path: Path) -> None:
    tiers = tiers_on(tmp_path, capacity=int(1.5 * STEP_BYTES))
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    with ckptstore.CheckpointManager(tiers, options=opts) as mgr:
        handle = mgr.save(1, tree(1))
        assert handle is not None
        handle.wait()
        mgr.wait_until_finished()  # promoted: step 1 may leave the fast tier when needed
        handle = mgr.save(2, tree(2))
        assert handle is not None
        handle.wait()
        assert ckptstore.list_steps_sync(tiers.fast) == [2]
        mgr.wait_until_finished()
    blocked = tiers_on(tmp_path / "other", capacity=STEP_BYTES // 2)
    with ckptstore.CheckpointManager(blocked, options=opts) as mgr:
        handle = mgr.save(1, tree(1))
        assert handle is not None
        with pytest.raises(ckptstore.InsufficientSpaceError):
            handle.wait()


async def test_host_parts_of_durable_steps_are_evictable(tmp_path: Path) -> None:
    """On host-local fast tiers a host holds staged parts (no COMMITTED): the part of a step
    committed on the durable tier from the same attempt may go, an unpromoted one may not."""
    fast = SmallDisk(tmp_path / "nvme", capacity=int(2.5 * STEP_BYTES))
    durable = LocalBackend(tmp_path / "bucket")
    for step in (1, 2):
        attempt = layout.new_attempt()
        await fast.write(f"{step}/{attempt}/state/ocdbt.process_1/d/x", bytes(STEP_BYTES))
        await fast.create(f"{step}/STAGED", Staged(step, attempt, 1, 2).to_bytes())
        if step == 1:  # merged and committed on the durable tier by the promotion
            marker = Marker(step, attempt, "sha256:" + "0" * 64, "token", 0.0)
            await durable.create(f"{step}/COMMITTED", marker.to_bytes())
    assert await promoted_steps(fast, durable) == [1]
    assert await ensure_room(fast, Room(durable, 0), STEP_BYTES) == [1]
    assert not (tmp_path / "nvme" / "1").exists() and (tmp_path / "nvme" / "2" / "STAGED").exists()
    with pytest.raises(ckptstore.InsufficientSpaceError):
        await ensure_room(fast, Room(durable, 0), 2 * STEP_BYTES)


async def test_an_incremental_save_counts_what_it_writes_and_never_evicts_its_base(
    tmp_path: Path,
) -> None:
    """Step 1 promoted and on the fast tier; too little room left for a full save, enough
    for step 2's changed leaves: the incremental save on base 1 evicts nothing (step 1 is
    its base, and its frozen leaves are only referenced) and references them."""
    from tests.checkpoint.helpers import FROZEN, assert_same, lora

    fast = SmallDisk(tmp_path / "nvme", capacity=1 << 40)
    tiers = ckptstore.Tiered(fast, str(tmp_path / "bucket"), free_margin=4096)
    await ckptstore.save(tiers, lora(1), step=1)
    await ckptstore.promote(tiers)
    used = fast.capacity - int(await supports.free_bytes(fast) or 0)
    fast.capacity = used + FROZEN.nbytes // 2  # room for the adapters, not for the base again
    result = await ckptstore.save(tiers, lora(2), step=2, base=1)
    assert result.bytes_referenced >= FROZEN.nbytes
    assert await ckptstore.list_steps(tiers.fast) == [1, 2]
    assert_same(await ckptstore.restore(tiers, step=2), lora(2))
