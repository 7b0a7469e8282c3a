"""The storage benchmark still runs end to end (a small, quick configuration)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_storage_benchmark_quick_run() -> None:
    # The default scratch directory: on the project's disk (dd oflag=direct needs a real one).
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "storage.py"), "--quick", "--no-write-results"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "| backend | op" in out
    for backend in ("local", "memory", "s3", "gcs"):
        assert f"| {backend} " in out, out
    assert "floors:" in out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def test_small_leaves_benchmark_quick_run() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "small_leaves.py"),
            "--quick",
            "--no-write-results",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for writer in ("ocdbt_keys", "packs", "dd_direct"):
        assert f"| {writer} " in proc.stdout, proc.stdout
    scratch = re.search(r"^scratch directory: (.+)$", proc.stdout, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up
