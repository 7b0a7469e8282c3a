"""`benchmarks/partial.py --quick` runs end to end (tiny sizes, no result files)."""

from __future__ import annotations

import pytest

from tests.benchmarks.helpers import quick_run

pytest.importorskip("moto", reason="the benchmark runs a moto S3 server")


def test_partial_benchmark_quick_runs() -> None:
    out = quick_run("partial.py", timeout=120)
    for metric in ("local write_bytes / payload", "S3 object bytes", "time: Orbax + fsync"):
        assert metric in out
    assert "floors:" in out
