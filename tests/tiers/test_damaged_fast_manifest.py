"""A tiered manager reads a step's metadata where `restore` reads it (`tiers.read`: the
nearest good copy), and opens where the fast copy's manifest is damaged: its start-up `gc`
skips, with a warning, instead of refusing to open."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import ckptstore


def _damage_fast_manifest(fast: Path, step: int) -> None:
    (manifest,) = (fast / str(step)).glob("*/manifest.json")
    manifest.write_bytes(b'{"not": "a manifest"')


@pytest.mark.parametrize("gc_on_start", [True, False])
def test_a_damaged_fast_manifest_neither_stops_the_manager_nor_its_metrics(
    tmp_path: Path, gc_on_start: bool, caplog: pytest.LogCaptureFixture
) -> None:
    tiered = ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=str(tmp_path / "durable"))
    state = {"w": np.arange(1024, dtype=np.float32)}
    options = ckptstore.ManagerOptions(handle_sigterm=False, gc_on_start=gc_on_start)
    with ckptstore.CheckpointManager(tiered, options=options) as mgr:
        mgr.save(1, state, metrics={"loss": 0.25}, force=True)
    _damage_fast_manifest(tmp_path / "nvme", 1)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        mgr = ckptstore.CheckpointManager(tiered, options=options)
    try:
        if gc_on_start:  # in the background: done once the start-up work is
            with caplog.at_level(logging.WARNING, logger="ckptstore"):
                mgr.wait_until_finished()
            assert "start-up gc skipped" in caplog.text
        assert mgr.all_steps() == [1]
        assert mgr.metrics(1) == {"loss": 0.25}  # from the durable copy, as restore reads
        np.testing.assert_array_equal(mgr.restore(1)["w"], state["w"])
    finally:
        mgr.close()
