"""Helpers the benchmark smoke tests share: a quick run of one benchmark script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def quick_run(script: str, *extra: str, timeout: float) -> str:
    """``benchmarks/<script> --quick --no-write-results [extra]``, which must succeed; its
    stdout."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / script),
            "--quick",
            "--no-write-results",
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout
