"""No empty directories on local disk: `delete_step`, keep policies, tier eviction and trims
leave a deleted step's directory holding its revocation record alone (`REVOKED.<n>`, kept a
day: docs/architecture.md), and `gc` (once that and the step's tombstones expire) removes
the directory with its last entry; a writer whose directory a concurrent prune removes
makes it again."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends import local
from ckptstore.backends.local import LocalBackend
from ckptstore.protocol import fates
from tests.tiers.helpers import STEP_BYTES, tiers_on, tree


def empty_dirs(root: Path) -> list[str]:
    return sorted(
        os.path.relpath(where, root)
        for where, dirs, files in os.walk(root)
        if not dirs and not files and Path(where) != root
    )


def step_dirs(root: Path) -> list[int]:
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def live_dirs(root: Path) -> list[int]:
    """Step directories holding more than revocation records."""
    return [
        s
        for s in step_dirs(root)
        if any(not p.name.startswith("REVOKED.") for p in (root / str(s)).iterdir())
    ]


def tombstones_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if a day had passed since each deletion (`fates.CLAIM_TTL`)."""
    monkeypatch.setattr(fates, "CLAIM_TTL", 0.0)


def test_quick_start_loop_leaves_no_empty_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    keep = ckptstore.policies.KeepLatest(3)
    with ckptstore.CheckpointManager(root, keep_policy=keep) as mgr:
        for step in range(1, 31):
            mgr.save(step, {"w": np.full((256,), step, np.float32), "step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [28, 29, 30]
    assert live_dirs(root) == [28, 29, 30] and empty_dirs(root) == []
    ckptstore.delete_step_sync(root, 28)
    assert live_dirs(root) == [29, 30] and empty_dirs(root) == []
    tombstones_expire(monkeypatch)
    ckptstore.gc_sync(root, older_than=0)
    assert step_dirs(root) == [29, 30] and empty_dirs(root) == []


async def test_tier_trims_evictions_and_tombstones_leave_no_empty_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = tiers_on(tmp_path, capacity=int(3.5 * STEP_BYTES))
    tiers = ckptstore.Tiered(small.fast, small.durable, keep_fast=2, free_margin=4096)
    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    for step in (1, 2):
        await ckptstore.save(tiers, tree(step), step=step)
    await ckptstore.promote(tiers)
    await ckptstore.save(tiers, tree(3), step=3)
    await ckptstore.save(tiers, tree(4), step=4)  # evicts 1 (no room)
    assert await ckptstore.list_steps(tiers.fast) == [2, 3, 4]
    await ckptstore.promote(tiers)  # keep_fast=2 trims 2
    assert await ckptstore.list_steps(tiers.fast) == [3, 4]
    assert live_dirs(fast) == [3, 4] and empty_dirs(fast) == []
    # delete_step on tiers leaves the fast copy's tombstone (for a promotion in flight) ...
    await ckptstore.delete_step(tiers, 3)
    assert live_dirs(fast) == [3, 4] and empty_dirs(fast) == []
    assert live_dirs(durable) == [1, 2, 4] and empty_dirs(durable) == []
    # ... until gc collects it, a day later: then its directory goes too.
    tombstones_expire(monkeypatch)
    await ckptstore.gc(tiers, older_than=0)
    assert step_dirs(fast) == [4] and empty_dirs(fast) == []
    assert step_dirs(durable) == [1, 2, 4] and empty_dirs(durable) == []


async def test_gc_removes_step_directories_left_empty_before(tmp_path: Path) -> None:
    root = tmp_path / "run"
    await ckptstore.save(root, tree(1), step=1)
    for step in (2, 3):
        (root / str(step)).mkdir()  # what older versions left behind
    (root / "4" / "attempt-x").mkdir(parents=True)  # not only empty: kept
    (root / "4" / "attempt-x" / "f").write_bytes(b"x")
    (root / "notes").mkdir()  # not a step: not ckptstore's to remove
    removed = await ckptstore.gc(root, older_than=3600)
    assert removed.entries == []
    assert step_dirs(root) == [1, 4] and empty_dirs(root) == ["notes"]
    dry = tmp_path / "dry"
    (dry / "5").mkdir(parents=True)
    await ckptstore.gc(dry, older_than=0, dry_run=True)
    assert (dry / "5").is_dir()  # a dry run removes nothing


async def test_prune_dirs_removes_only_empty_directories(tmp_path: Path) -> None:
    async with LocalBackend(tmp_path / "root") as backend:
        await backend.write("7/a/b/f", b"x")
        await backend.prune_dirs("7/a/b")  # holds a file: stays, and so do its parents
        assert await backend.read("7/a/b/f") == b"x"
        await backend.delete("7/a/b/f")
        (tmp_path / "root" / "7" / "keep").mkdir()
        await backend.prune_dirs("7/a/b")  # b and a go; 7 holds "keep"
        assert sorted(os.listdir(tmp_path / "root" / "7")) == ["keep"]
        await backend.prune_dirs("7/keep")
        assert os.listdir(tmp_path / "root") == []  # never the root itself
        await backend.prune_dirs("7/gone")  # already gone: nothing to do


def test_a_writer_makes_its_directory_again_when_pruned_meanwhile(tmp_path: Path) -> None:
    """Real threads on a real disk: one writes files into ``9/x/`` and deletes them, the
    other prunes ``9/x`` and ``9`` every few hundred microseconds (a pruner spinning with
    no pause at all can starve a writer: gc prunes once per step). Every write lands
    whole, and no directory with a file in it is ever removed."""
    root = tmp_path / "root"
    root.mkdir()
    stop = threading.Event()
    pruned = [0]

    def prune() -> None:
        while not stop.is_set():
            for d in (root / "9" / "x", root / "9"):
                if local._remove_empty_dir(str(d)):
                    pruned[0] += 1
            time.sleep(0.0002)

    pruner = threading.Thread(target=prune)
    pruner.start()
    try:
        for i in range(400):
            path = root / "9" / "x" / f"f{i}"
            local.put_file(path, [f"data {i}".encode()], exclusive=True, fsync=False)
            assert path.read_bytes() == f"data {i}".encode()
            path.unlink()
    finally:
        stop.set()
        pruner.join()
    assert pruned[0] > 0
