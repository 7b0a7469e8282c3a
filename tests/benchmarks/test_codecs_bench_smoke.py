"""benchmarks/codecs.py runs end to end (quick configuration): the demo's model trained a
few steps, saved locally (ckptstore's contenders and Orbax's) and to moto S3 through the
rate-limited fault proxy, each restored; the floor is computed but not judged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.benchmarks.helpers import quick_run


@pytest.mark.slow
def test_codecs_benchmark_quick_run() -> None:
    out = quick_run("codecs.py", timeout=300)
    stored = {}
    rows = [
        ("ckptstore none", "local"),
        ("ckptstore zstd:1", "local"),
        ("ckptstore zstd:3", "local"),
        ("ckptstore bf16", "local"),
        ("ckptstore bf16+zstd:1", "local"),
        ("orbax default (zstd:1)", "local"),
        ("orbax use_compression=False", "local"),
        ("ckptstore none", "s3"),
        ("ckptstore zstd:1", "s3"),
    ]
    for contender, target in rows:
        pattern = rf"^\| {re.escape(contender)} +\| {target} +\| ([\d.]+) MiB"
        row = re.search(pattern, out, re.M)
        assert row is not None, out
        stored[contender, target] = float(row.group(1))
    none = stored["ckptstore none", "local"]
    assert stored["ckptstore zstd:3", "local"] < 0.95 * none, stored
    assert stored["ckptstore bf16", "local"] < 0.55 * none, stored
    assert stored["ckptstore zstd:1", "s3"] < 0.95 * stored["ckptstore none", "s3"], stored
    judged = r"^\| ckptstore zstd:1 +\|.*\| not judged \(quick\) +\|.*\|$"  # then the server's
    assert re.search(judged, out, re.M), out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up
