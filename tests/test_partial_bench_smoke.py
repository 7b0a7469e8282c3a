"""`benchmarks/partial.py --quick` runs end to end (tiny sizes, no result files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("moto", reason="the benchmark runs a moto S3 server")


def test_partial_benchmark_quick_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "partial.py"), "--quick", "--no-write-results"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for metric in ("local write_bytes / payload", "S3 object bytes", "time: Orbax + fsync"):
        assert metric in proc.stdout
    assert "floors:" in proc.stdout
