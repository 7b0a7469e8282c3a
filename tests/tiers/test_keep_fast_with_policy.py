"""``keep_fast=N`` leaves N steps on the fast tier when a keep policy also deletes steps:
trimming comes after the policy, so it never counts a step the policy deletes next."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ckptstore
from ckptstore import policies as P


def test_keep_fast_counts_only_the_steps_the_keep_policy_keeps(tmp_path: Path) -> None:
    tiered = ckptstore.Tiered(
        fast=str(tmp_path / "nvme"), durable=str(tmp_path / "durable"), keep_fast=2
    )
    keep = P.KeepAnyOf(P.KeepLatest(1), P.KeepBest(1, "acc"))
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    accuracy = {1: 0.9, 2: 0.1, 3: 0.2, 4: 0.3, 5: 0.4}  # step 1 stays the best
    with ckptstore.CheckpointManager(tiered, keep_policy=keep, options=options) as mgr:
        for step, acc in accuracy.items():
            mgr.save(step, {"x": np.full(8, step)}, metrics={"acc": acc})
            mgr.wait_until_finished()
            on_fast = ckptstore.list_steps_sync(str(tmp_path / "nvme"))
            kept = ckptstore.list_steps_sync(str(tmp_path / "durable"))
            assert kept == sorted({1, step}), step  # the best and the latest
            assert on_fast == kept, step  # both kept steps: keep_fast=2 holds them
    got = ckptstore.restore_sync(str(tmp_path / "nvme"), 1)
    np.testing.assert_array_equal(got["x"], np.full(8, 1))
