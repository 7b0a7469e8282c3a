"""`benchmarks/data_files.py --quick` runs end to end and records what it compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_data_files_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "data_files.json"
    script = REPO / "benchmarks" / "data_files.py"
    cmd = [sys.executable, str(script), "--quick", "--only", "b", "--sizes", "1,64"]
    proc = subprocess.run(
        [*cmd, "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())["results"]["b"]
    for op in ("save", "restore"):
        assert set(got[op]) == {"1", "64"} and all(len(s["runs_s"]) == 2 for s in got[op].values())
    # Files of 1 MiB: the 27 MiB tree's large leaves fill many; of 64 MiB, one per store.
    assert got["data_files"]["1"] > 2 * got["data_files"]["64"] > 0, got["data_files"]
