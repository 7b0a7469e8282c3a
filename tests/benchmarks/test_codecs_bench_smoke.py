"""benchmarks/codecs.py runs end to end (quick configuration)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.benchmarks.helpers import quick_run


def test_codecs_benchmark_quick_run() -> None:
    out = quick_run("codecs.py", timeout=300)
    stored = {}
    for contender in ("ckptstore none", "ckptstore zstd:1", "ckptstore zstd:3", "orbax (zstd:3)"):
        row = re.search(rf"^\| {re.escape(contender)} +\| ([\d.]+) MiB", out, re.M)
        assert row is not None, out
        stored[contender] = float(row.group(1))
    assert stored["ckptstore zstd:3"] < 0.95 * stored["ckptstore none"], stored
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up
