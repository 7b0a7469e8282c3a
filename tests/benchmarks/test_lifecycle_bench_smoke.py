"""The training-loop and tiered benchmarks run end to end with ``--quick`` (no result file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ROWS = {
    "training_loop.py": ["pause per save", "save to durable", "loop time lost per save"],
    "tiered.py": [
        "save return (tiered)",
        "first save of a process (tiered)",
        "promotion",
        "save to durable (tiered)",
    ],
}


@pytest.mark.parametrize("script", sorted(ROWS))
def test_benchmark_quick_run(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--no-write-results"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for row in ROWS[script]:
        assert row in out, out
    assert "floors:" in out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up
