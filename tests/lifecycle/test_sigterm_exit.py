"""SIGTERM ends a program whose loop never reads `CheckpointManager.preempted` (every script
written for Orbax), as it would without ckptstore, once the preemption's save is committed;
a loop that reads it stops by itself, as before; a handler of the program's own decides.
Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore

REPO = Path(__file__).resolve().parents[2]

LOOP = """
import signal, sys, time
import numpy as np
import ckptstore
from ckptstore import policies as pol

root, style = sys.argv[1], sys.argv[2]
if style == "own-handler":
    signal.signal(signal.SIGTERM, lambda *a: print("own handler", flush=True))
policy = pol.AnyOf(pol.EveryNSteps(1000), pol.OnPreemption())
mgr = ckptstore.CheckpointManager(root, save_policy=policy)
for step in range(1, 100_000):
    state = {"w": np.full(1024, float(step), np.float32)}
    handle = mgr.save(step, state)
    if step == 3:
        print("ready", flush=True)
    if style == "reads" and mgr.preempted:  # true at the call that saved: wherever it lands
        print(f"stopped at {step} ({handle is not None})", flush=True)
        break
    if style == "own-handler" and step == 60:
        break
    time.sleep(0.005)
mgr.close()
print("finished", flush=True)
"""


def run_loop(tmp_path: Path, style: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), style],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), start


def test_a_loop_that_never_asks_exits_on_sigterm_after_its_save(tmp_path: Path) -> None:
    done, start = run_loop(tmp_path, "never-asks")
    assert done.returncode == -signal.SIGTERM, (done.stdout, done.stderr[-2000:])
    assert time.monotonic() - start < 60
    assert "finished" not in done.stdout
    lines = [line for line in done.stderr.splitlines() if "ckptstore" in line]
    assert len(lines) == 1 and "SIGTERM: exiting after committing step" in lines[0], lines
    steps = ckptstore.list_steps_sync(str(tmp_path / "run"))
    assert len(steps) == 1 and f"step {steps[0]}" in lines[0]  # the preemption's step
    got = ckptstore.restore_sync(str(tmp_path / "run"))
    np.testing.assert_array_equal(got["w"], np.full(1024, float(steps[0]), np.float32))


def test_a_loop_that_reads_preempted_stops_by_itself(tmp_path: Path) -> None:
    done, _ = run_loop(tmp_path, "reads")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stopped at" in done.stdout and "finished" in done.stdout
    stopped = int(done.stdout.split("stopped at ")[1].split()[0])
    assert f"stopped at {stopped} (True)" in done.stdout  # that call saved the step
    assert ckptstore.list_steps_sync(str(tmp_path / "run")) == [stopped]
    assert "SIGTERM: exiting" not in done.stderr


@pytest.mark.parametrize("style", ["own-handler"])
def test_a_handler_of_the_programs_own_decides(tmp_path: Path, style: str) -> None:
    done, _ = run_loop(tmp_path, style)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "own handler" in done.stdout and "finished" in done.stdout
    assert "SIGTERM: exiting" not in done.stderr
