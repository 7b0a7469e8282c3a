"""`make demo` works: preempted, resumed bit-exact, finished (a shorter run than the demo's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "demo" / "run.py"


def test_demo_preempts_resumes_and_finishes() -> None:
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "40", "--save-every", "10", "--preempt-at", "14"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "-- preempted at step" in out and "(bit-exact)" in out
    assert "-- finished at step 40" in out and "FAILED" not in out
    line = next(line for line in out.splitlines() if line.startswith("steps kept"))
    kept = json.loads(line[line.index("[") : line.index("]") + 1])
    assert kept[-3:] == [20, 30, 40] and len(kept) <= 4  # the latest 3, and the best if older
