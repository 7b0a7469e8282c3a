"""`make demo` works: preempted, resumed bit-exact, finished (a shorter run than the demo's);
the adapter phase's later saves write the adapters only, and its kept steps restore bit-exact.

`make demo S3=1` (the same against an embedded moto S3 server) takes as long again, so it runs
only with ``CKPTSTORE_DEMO_S3=1`` (``CKPTSTORE_DEMO_S3=1 pytest tests/lifecycle/test_demo.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "demo" / "run.py"
S3 = pytest.param(
    ["--s3"],
    marks=pytest.mark.skipif(
        os.environ.get("CKPTSTORE_DEMO_S3") != "1", reason="set CKPTSTORE_DEMO_S3=1 to run"
    ),
    id="s3",
)


@pytest.mark.parametrize("where", [pytest.param([], id="local"), S3])
@pytest.mark.slow
def test_demo_preempts_resumes_and_finishes(where: list[str]) -> None:
    args = ["--steps", "40", "--save-every", "10", "--preempt-at", "14", "--adapter-steps", "3"]
    args += where
    proc = subprocess.run(
        [sys.executable, str(DEMO), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ("on moto at http://127.0.0.1:" in out.splitlines()[0]) == bool(where)
    assert "-- preempted at step" in out and "(bit-exact)" in out
    assert "-- finished at step 40" in out and "FAILED" not in out
    line = next(line for line in out.splitlines() if line.startswith("steps kept"))
    kept = json.loads(line[line.index("[") : line.index("]") + 1])
    assert kept[-3:] == [20, 30, 40] and len(kept) <= 4  # the latest 3, and the best if older
    saves = re.findall(r"^  step (\d+)  wrote +([\d,]+) B of ([\d,]+) B", out, re.M)
    assert [int(step) for step, _, _ in saves] == [1, 2, 3], out
    written = [int(w.replace(",", "")) for _, w, _ in saves]
    size = int(saves[0][2].replace(",", ""))
    assert written[0] == size and all(0 < w < size // 20 for w in written[1:]), written
    assert "  restored steps 2, 3 (bit-exact)" in out
