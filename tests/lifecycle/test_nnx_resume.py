"""An NNX model with Dropout trains through the manager, is SIGKILLed, and resumes
bit-exact: the same losses and the same final state as a run never interrupted, with no
user code for its typed PRNG keys (`nnx_worker.py`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flax.nnx")

REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def run(root: Path, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lifecycle.nnx_worker", str(root), str(STEPS), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode, lines


@pytest.mark.slow
def test_an_nnx_model_with_dropout_is_killed_and_resumes_bit_exact(tmp_path: Path) -> None:
    code, whole = run(tmp_path / "whole")
    assert code == 0
    losses = {line["step"]: line["loss"] for line in whole if "step" in line}
    assert sorted(losses) == list(range(1, STEPS + 1))

    code, first = run(tmp_path / "killed", "--die-at", "7")
    assert code == -signal.SIGKILL
    assert [line["step"] for line in first] == list(range(1, 8))
    code, second = run(tmp_path / "killed")
    assert code == 0
    resumed = [line for line in second if "step" in line]
    # The last step committed before the kill: 6 (saved every 2 steps; 7's never started).
    assert resumed[0]["step"] in (5, 7), resumed[0]
    for line in [*first, *resumed]:
        assert line["loss"] == losses[line["step"]], line  # bit-exact: the same float
    assert second[-1]["digest"] == whole[-1]["digest"]
