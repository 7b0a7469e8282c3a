"""Partial saves on every backend: many parts, replacement, failures, resume, O(N) bytes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.checkpoint.target import opened
from ckptstore.testing.faults import FaultyBackend, InjectedPermanentFault
from tests.checkpoint.helpers import part_tree, shared_target


def combined(n: int) -> dict[str, Any]:
    return {"layers": {str(k): part_tree(k)["layers"][str(k)] for k in range(n)}}


def assert_trees_equal(a: Any, b: Any) -> None:
    assert isinstance(a, dict) and isinstance(b, dict)
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], dict):
            assert_trees_equal(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype
            np.testing.assert_array_equal(a[key], b[key])


async def stored_bytes(backend: Backend) -> int:
    return sum([info.size async for info in backend.list()])


async def test_many_parts_then_finalize(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=3)
    for k in range(12):
        part = await session.add(part_tree(k))
        assert part.index == k
    assert await ckptstore.list_steps(any_backend) == []  # invisible before finalize
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        await ckptstore.restore(any_backend, step=3)
    result = await session.finalize()
    assert result.step == 3
    assert await ckptstore.list_steps(any_backend) == [3]
    assert_trees_equal(await ckptstore.restore(any_backend), combined(12))


async def test_bytes_stay_linear_and_nothing_is_copied(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=1)
    payload = 0
    for k in range(10):
        payload += (await session.add(part_tree(k))).nbytes
    before = {info.key: info.size async for info in any_backend.list()}
    await session.finalize()
    after = {info.key: info.size async for info in any_backend.list()}
    assert all(after[key] == size for key, size in before.items())  # parts untouched
    added = sum(size for key, size in after.items() if key not in before)
    assert added < 64 * 1024, f"finalize wrote {added} bytes"
    total = sum(after.values())
    metadata_allowance = 16 * 1024 * 10  # part records, zarr.json, B-tree nodes
    assert total <= 1.05 * payload + metadata_allowance, (total, payload)


async def test_duplicate_leaves_and_replacement(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=2)
    await session.add({"a": {"x": np.arange(10), "y": np.ones(3)}})
    with pytest.raises(ckptstore.DuplicateLeafError, match="a/x"):
        await session.add({"a": {"x": np.arange(4)}})
    # Replacement with another shape (another chunk grid) and dtype: the later part wins.
    await session.add({"a": {"x": np.arange(100, dtype=np.int8).reshape(4, 25)}}, replace=True)
    await session.add({"b": np.zeros(2)})
    await session.add({"a": {"x": np.full((3, 3), 7, np.float32)}}, replace=True)
    await session.add({"c": np.ones(1)})
    await session.add({"a": {"x": np.arange(100, dtype=np.int8).reshape(4, 25)}}, replace=True)
    await session.finalize()
    out = await ckptstore.restore(any_backend)
    np.testing.assert_array_equal(out["a"]["x"], np.arange(100, dtype=np.int8).reshape(4, 25))
    np.testing.assert_array_equal(out["c"], np.ones(1))
    np.testing.assert_array_equal(out["a"]["y"], np.ones(3))
    np.testing.assert_array_equal(out["b"], np.zeros(2))


async def test_empty_finalize_and_committed_step_refused(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=5)
    with pytest.raises(ckptstore.CkptStoreError, match="no parts"):
        await session.finalize()
    await ckptstore.save(any_backend, {"x": np.arange(2)}, step=6)
    with pytest.raises(ckptstore.AlreadyExistsError):
        await ckptstore.partial_save(any_backend, step=6)


async def test_failed_part_is_discarded_on_resume(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=4)
    await session.add(part_tree(0))
    # The part's record cannot be created: its data is written but the part is not complete.
    faulty = FaultyBackend(
        any_backend,
        fail_on={1},
        ops={"create"},
        error="permanent",
        retry=RetryPolicy(max_attempts=1),
    )
    broken = await ckptstore.partial_save(faulty, step=4)
    assert [p.index for p in broken.parts] == [0]
    with pytest.raises(InjectedPermanentFault):
        await broken.add(part_tree(1))
    item_dir = f"4/{broken.attempt}/state"
    unrecorded = [n for n in await any_backend.list_dir(item_dir) if n.startswith("pending_1-")]
    assert len(unrecorded) == 1  # data of the failed part is there, but no record

    resumed = await ckptstore.partial_save(any_backend, step=4)
    assert resumed.attempt == broken.attempt == session.attempt
    assert [p.index for p in resumed.parts] == [0]
    for k in (1, 2):
        await resumed.add(part_tree(k))
    assert resumed.parts[1].dir != unrecorded[0]  # a new directory, nothing overwritten
    await resumed.finalize()
    assert_trees_equal(await ckptstore.restore(any_backend), combined(3))
    # The unrecorded part is garbage: unused by the commit, collected by gc.
    removal = await ckptstore.gc(any_backend, older_than=0)
    assert removal.entries == [f"{item_dir}/{unrecorded[0]}"]
    assert_trees_equal(await ckptstore.restore(any_backend), combined(3))


async def test_transient_faults_during_parts_are_retried(any_backend: Backend) -> None:
    faulty = FaultyBackend(
        any_backend,
        fail_rate=0.3,
        seed=7,
        retry=RetryPolicy(max_attempts=8, base_delay=0.001, max_delay=0.01),
    )
    session = await ckptstore.partial_save(faulty, step=8)
    for k in range(4):
        await session.add(part_tree(k))
    await session.finalize()
    assert faulty.injected > 0
    assert_trees_equal(await ckptstore.restore(any_backend), combined(4))


IMPORTER_KILLED_MID_PART = textwrap.dedent(
    """
    import asyncio, sys, time
    import numpy as np
    import ckptstore
    import ckptstore.datapath.arrays as arrays_module
    from tests.campaigns.killpoints import first_bytes
    from tests.checkpoint.helpers import part_tree

    real_write = arrays_module.write_leaves
    calls = 0

    async def write_leaves(*args, **kwargs):
        global calls
        calls += 1
        task = asyncio.ensure_future(real_write(*args, **kwargs))
        if calls == 4:
            await first_bytes(*args)
            print("mid part", flush=True)
            time.sleep(60)  # killed here, while part 3 is being written
        return await task

    arrays_module.write_leaves = write_leaves

    async def main():
        session = await ckptstore.partial_save(sys.argv[1], step=7)
        for k in range(6):
            await session.add(part_tree(k))
        await session.finalize()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
async def test_killed_importer_resumes_to_the_same_checkpoint(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    target = shared_target(kind, request, tmp_path, "ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-c", IMPORTER_KILLED_MID_PART, target],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    assert line.strip() == "mid part"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)

    assert await ckptstore.list_steps(target) == []
    session = await ckptstore.partial_save(target, step=7)
    assert [p.index for p in session.parts] == [0, 1, 2]  # part 3 was never recorded
    for k in range(3, 6):
        await session.add(part_tree(k))
    await session.finalize()
    assert_trees_equal(await ckptstore.restore(target), combined(6))

    # The same as a run that was never interrupted.
    clean = shared_target(kind, request, tmp_path, "clean")
    async with await ckptstore.partial_save(clean, step=7) as uninterrupted:
        for k in range(6):
            await uninterrupted.add(part_tree(k))
        await uninterrupted.finalize()
    manifests = []
    for t in (target, clean):
        async with opened(t) as backend:
            manifests.append(await ckptstore.read_manifest(backend, 7))
    first, second = (m.items["state"] for m in manifests)
    assert first.leaves == second.leaves
    assert first.structure == second.structure


async def test_nested_leaves_are_refused_before_writing(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=2)
    await session.add({"a": {"x": np.zeros(2)}, "b": np.ones(2)})
    before = await stored_bytes(any_backend)
    for bad in ({"a": np.arange(3)}, {"b": {"y": np.arange(3)}}):
        for replace in (False, True):
            with pytest.raises(ckptstore.CkptStoreError, match="nest"):
                await session.add(bad, replace=replace)
    assert await stored_bytes(any_backend) == before  # refused before anything was written
    await session.add({"a": {"z": np.arange(3)}})  # a sibling is fine
    await session.finalize()
    out = await ckptstore.restore(any_backend, step=2)
    assert sorted(out["a"]) == ["x", "z"]


async def test_sessions_resume_start_anew_and_abandon(any_backend: Backend) -> None:
    first = await ckptstore.partial_save(any_backend, step=6)
    await first.add(part_tree(0))
    again = await ckptstore.partial_save(any_backend, step=6)  # resumes the newest session
    assert again.attempt == first.attempt and [p.index for p in again.parts] == [0]
    fresh = await ckptstore.partial_save(any_backend, step=6, resume=False)
    assert fresh.attempt != first.attempt and fresh.parts == []
    await fresh.add(part_tree(1))
    exact = await ckptstore.partial_save(any_backend, step=6, attempt=first.attempt)
    assert [p.index for p in exact.parts] == [0]
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        await ckptstore.partial_save(
            any_backend, step=6, attempt="attempt-20200101T000000-0123456789ab"
        )
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        await ckptstore.partial_save(any_backend, step=6, attempt="../../etc")
    await exact.abandon()
    with pytest.raises(ckptstore.CkptStoreError, match="abandoned"):
        await exact.add(part_tree(2))
    # Only the fate record stays: a zombie of the session can no longer commit it.
    left = [i.key async for i in any_backend.list(f"6/{first.attempt}")]
    assert left == [f"6/{first.attempt}/FATE"]
    assert b'"abandon"' in await any_backend.read(left[0])
    latest = await ckptstore.partial_save(any_backend, step=6)  # the other session is left
    assert latest.attempt == fresh.attempt
    await latest.finalize()
    assert_trees_equal(await ckptstore.restore(any_backend, step=6), part_tree(1))
