"""Orbax's step metrics (``save(metrics=...)``, kept as the reserved item ``metrics``) are
step metrics in ckptstore too, imported and read in place: ``mgr.metrics(step)``,
``mgr.best_step()`` and `KeepBest` answer as Orbax's ``best_fn`` did, and ``import-orbax``
imports every step (or a range), so the best-step history survives a move. Against a real
Orbax 0.12.8 run with ``best_fn`` on an eval loss and ``max_to_keep``."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore import policies as pol
from ckptstore.cli.main import main
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    UnsupportedOperationError,
)
from tests.orbax.conftest import assert_bit_exact, saved_form

#: Eval loss by step; Orbax keeps the 3 lowest (max_to_keep=3 with best_fn), not the latest.
LOSS = {10: 0.5, 20: 0.2, 30: 0.4, 40: 0.9, 50: 0.3, 60: 0.7}


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((2, 3), step, np.float32), "count": np.int32(step)}


def metrics(step: int) -> dict[str, Any]:
    return {"eval_loss": LOSS[step], "accuracy": 1 - LOSS[step], "epoch": step // 10}


@dataclass(frozen=True)
class OrbaxSaw:
    """What Orbax's own manager says of the run."""

    steps: list[int]
    metrics: dict[int, Any]
    best: int | None


def best_run(root: Path) -> OrbaxSaw:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=3, best_fn=lambda m: m["eval_loss"], best_mode="min"
    )
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in LOSS:
            mngr.save(step, args=ocp.args.StandardSave(state(step)), metrics=metrics(step))
        mngr.wait_until_finished()
        steps = mngr.all_steps()
        return OrbaxSaw(steps, {s: mngr.metrics(s) for s in steps}, mngr.best_step())


def keep_best() -> pol.KeepPolicy:
    return pol.KeepBest(3, "eval_loss", mode="min")


def opts() -> ckptstore.ManagerOptions:
    return ckptstore.ManagerOptions(handle_sigterm=False)


def test_all_steps_import_keeps_metrics_and_the_best_step(tmp_path: Path) -> None:
    root, dst = tmp_path / "orbax", tmp_path / "cs"
    saw = best_run(root)
    assert saw.steps == [20, 30, 50] and saw.best == 20  # Orbax's own answer
    assert main(["import-orbax", str(root), str(dst), "--all-steps"]) == 0
    assert ckptstore.list_steps_sync(dst) == saw.steps
    assert ckptstore.read_manifest_sync(dst, 20).item_names == ["state"]  # not an item
    with ckptstore.CheckpointManager(dst, keep_policy=keep_best(), options=opts()) as mgr:
        assert {s: mgr.metrics(s) for s in mgr.all_steps()} == saw.metrics
        assert mgr.metadata(30).metrics == saw.metrics[30]
        assert mgr.best_step() == saw.best
        assert_bit_exact(mgr.restore(20), saved_form(state(20)))
        for step, loss in ((70, 0.8), (80, 0.6)):  # worse than every imported step
            mgr.save(step, state(step), metrics={"eval_loss": loss})
        mgr.wait_until_finished()
        assert mgr.best_step() == 20
        assert mgr.all_steps() == [20, 30, 50, 80]  # the 3 best, and the latest


def test_in_place_metrics_and_best_step_match_orbax(tmp_path: Path) -> None:
    root = tmp_path / "orbax"
    saw = best_run(root)
    with warnings.catch_warnings(action="ignore"):  # "restores its steps but does not save"
        mgr = ckptstore.CheckpointManager(root, keep_policy=keep_best(), options=opts())
    with mgr:
        assert mgr.all_steps() == saw.steps
        assert {s: mgr.metrics(s) for s in saw.steps} == saw.metrics  # metrics(20) raised
        assert mgr.best_step() == saw.best
        with pytest.raises(CheckpointNotFoundError, match=r"\[20, 30, 50\]"):
            mgr.metrics(40)  # deleted by Orbax
        with pytest.raises(UnsupportedOperationError, match=r"--all-steps.*best_step"):
            mgr.save(70, state(70), force=True)  # the way on keeps the history


def test_a_range_of_steps_and_resuming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, dst = tmp_path / "orbax", tmp_path / "cs"
    saw = best_run(root)
    assert main(["import-orbax", str(root), str(dst), "--steps", "25:50", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in done["steps"]] == [30, 50] and done["already"] == []
    assert ckptstore.list_steps_sync(dst) == [30, 50]
    # Again, wider: what is already imported from there is left as it is.
    result = ckptstore.import_orbax_steps_sync(root, dst, first=None, last=30)
    assert sorted(result.steps) == [20] and result.already == [30]
    assert ckptstore.list_steps_sync(dst) == [20, 30, 50]
    with ckptstore.CheckpointManager(dst, keep_policy=keep_best(), options=opts()) as mgr:
        assert {s: mgr.metrics(s) for s in mgr.all_steps()} == saw.metrics
    # A single step carries its metrics too.
    one = tmp_path / "one"
    assert main(["import-orbax", str(root), str(one), "--step", "50"]) == 0
    assert ckptstore.read_manifest_sync(one, 50).metadata["metrics"] == saw.metrics[50]


def test_an_all_steps_import_refuses_a_step_committed_otherwise(tmp_path: Path) -> None:
    root, dst = tmp_path / "orbax", tmp_path / "cs"
    best_run(root)
    ckptstore.save_sync(dst, state(0), step=30)  # not imported from the Orbax run
    with pytest.raises(AlreadyExistsError, match="30"):
        ckptstore.import_orbax_steps_sync(root, dst)
    assert ckptstore.list_steps_sync(dst) == [30]  # nothing else committed


def test_step_range_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, dst = tmp_path / "orbax", tmp_path / "cs"
    best_run(root)
    with pytest.raises(CheckpointNotFoundError, match=r"no finalized Orbax step.*\[20, 30, 50\]"):
        ckptstore.import_orbax_steps_sync(root, dst, first=31, last=49)
    for argv in (["--steps", "30:20"], ["--steps", "x:20"], ["--all-steps", "--step", "20"]):
        with pytest.raises(SystemExit) as usage:  # argparse's usage error
            main(["import-orbax", str(root), str(dst), *argv])
        assert usage.value.code == 2 and "import-orbax" in capsys.readouterr().err, argv
    assert main(["import-orbax", str(root), str(dst), "--all-steps", "--as-step", "5"]) == 2
    assert "--as-step" in capsys.readouterr().err
    assert not dst.exists()


def test_nan_metrics_cross_as_they_were_saved(tmp_path: Path) -> None:
    """Orbax writes a diverged loss as ``NaN`` (Python's json): it imports as NaN, as a
    ckptstore save keeps it, and is never the best step."""
    root, dst = tmp_path / "orbax", tmp_path / "cs"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["eval_loss"], best_mode="min")
    with ocp.CheckpointManager(root, options=options) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(state(1)), metrics={"eval_loss": 0.5})
        mngr.save(2, args=ocp.args.StandardSave(state(2)), metrics={"eval_loss": math.nan})
        mngr.wait_until_finished()
    ckptstore.import_orbax_steps_sync(root, dst)
    with ckptstore.CheckpointManager(dst, keep_policy=keep_best(), options=opts()) as mgr:
        assert math.isnan(mgr.metrics(2)["eval_loss"]) and mgr.best_step() == 1
