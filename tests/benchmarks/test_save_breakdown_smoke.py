"""`benchmarks/save_breakdown.py --quick` runs end to end on one small tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_save_breakdown_quick_run() -> None:
    script = REPO / "benchmarks" / "save_breakdown.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--trees", "b"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for phase in ("| save ", "| write ", "| merge ", "| restore "):
        assert phase in proc.stdout, proc.stdout
    assert "TensorStore open" in proc.stdout and "chunks.checksum" in proc.stdout
