"""`benchmarks/tiered.py --quick` runs end to end (64 MiB, no result file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tiered_benchmark_quick_run() -> None:
    script = REPO / "benchmarks" / "tiered.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--no-write-results"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for row in ("save return (tiered)", "promotion", "save to durable (tiered)"):
        assert row in out, out
    assert "floors:" in out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up
