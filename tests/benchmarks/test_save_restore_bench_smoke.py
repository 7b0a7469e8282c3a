"""`benchmarks/save_restore.py --quick` runs end to end: trees a (with the fresh-process
saves and restores) and c (the one Orbax saves split), every phase, and the merge, at 1/250
size (a smoke run: the fixed costs of its fresh processes and of Orbax dominate at any size;
``--quick`` alone runs all four trees at 1/16), no results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_save_restore_benchmark_quick_run() -> None:
    script = REPO / "benchmarks" / "save_restore.py"
    proc = subprocess.run(
        [
            *(sys.executable, str(script), "--quick", "--scale", "0.004", "--no-write-results"),
            *("--trees", "a,c"),  # a: the fresh processes' phases; c: the tree Orbax splits
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    rows = ["vs dd direct+fsync", "vs Orbax + fsync", "restore (cold) vs raw read"]
    rows += ["restore (cold) vs reading its files into new memory"]
    rows += ["raw read into new memory, freed memory reclaimed by the host"]
    rows += ["restore (warm) vs Orbax", "peak memory", "first restore of a fresh process", "merge"]
    for tree in "ac":  # the trees asked for run
        assert f"tree {tree}:" in out, out
    for row in rows:
        assert row in out, out
    assert "floors:" in out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up
