"""Orbax runs whose step directories are named with ``step_prefix`` and
``step_format_fixed_length`` (``ckpt_00000010``), written by real Orbax 0.12.8: listed,
read in place, imported under their step numbers, and named by the manager's refusal
(they were no steps at all: "holds no Orbax checkpoint")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore.cli.main import main
from ckptstore.errors import CorruptCheckpointError, UnsupportedOperationError
from ckptstore.orbax.steps import orbax_step
from tests.orbax.conftest import assert_bit_exact, saved_form


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((4, 3), step, np.float32), "n": np.arange(5, dtype=np.int64) * step}


def prefixed_run(root: Path, steps: tuple[int, ...] = (10, 20)) -> None:
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=8)
    with ocp.CheckpointManager(root, options=options) as manager:
        for step in steps:
            manager.save(step, args=ocp.args.StandardSave(state(step)))
        manager.wait_until_finished()


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("10", 10),
        ("0", 0),
        ("ckpt_00000010", 10),
        ("my_run_7", 7),
        ("00000003", 3),
        ("_7", None),
        ("ckpt_", None),
        ("10.orbax-checkpoint-tmp-1733", None),
        ("ckpt_10.orbax-checkpoint-tmp-1733", None),
        ("ckpt_\uff11\uff10", None),  # full-width digits
        ("default", None),
    ],
)
def test_orbax_step_names(name: str, step: int | None) -> None:
    assert orbax_step(name) == step


def test_a_prefixed_run_is_listed_read_in_place_and_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, cs = tmp_path / "run", tmp_path / "cs"
    prefixed_run(root)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt_00000010", "ckpt_00000020"]
    assert ckptstore.list_steps_sync(root) == [10, 20]
    assert_bit_exact(ckptstore.restore_sync(root), saved_form(state(20)))
    assert_bit_exact(ckptstore.restore_sync(root, step=10), saved_form(state(10)))
    assert main(["ls", str(root), "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)] == [10, 20]
    assert main(["verify", str(root)]) == 0
    capsys.readouterr()
    assert main(["import-orbax", str(root), str(cs), "--step", "10"]) == 0
    assert ckptstore.list_steps_sync(cs) == [10]
    assert_bit_exact(ckptstore.restore_sync(cs, step=10), saved_form(state(10)))
    with ckptstore.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [10, 20]
        assert_bit_exact(mgr.restore(20), saved_form(state(20)))
        with pytest.raises(UnsupportedOperationError, match=r"import-orbax .* --step 20"):
            mgr.save(21, state(21), force=True)


def test_one_step_under_two_names_is_refused_naming_both(tmp_path: Path) -> None:
    root = tmp_path / "run"
    prefixed_run(root, steps=(10,))
    with ocp.CheckpointManager(root) as manager:  # a second run, without the prefix
        manager.save(10, args=ocp.args.StandardSave(state(11)))
        manager.wait_until_finished()
    with pytest.raises(CorruptCheckpointError, match=r"step 10 twice.*'10'.*'ckpt_00000010'"):
        ckptstore.restore_sync(root, step=10)


def test_a_named_step_is_found_without_looking_into_the_others(tmp_path: Path) -> None:
    """Reading step 20 lists the root and looks into step 20's directory only (it looked
    into every step's directory), so a step elsewhere under two names does not stand in
    its way; without a step it does."""
    root = tmp_path / "run"
    prefixed_run(root, steps=(10, 20))
    with ocp.CheckpointManager(root) as manager:  # step 10 again, without the prefix
        manager.save(10, args=ocp.args.StandardSave(state(11)))
        manager.wait_until_finished()
    assert_bit_exact(ckptstore.restore_sync(root, step=20), saved_form(state(20)))
    with pytest.raises(CorruptCheckpointError, match="step 10 twice"):
        ckptstore.restore_sync(root)
