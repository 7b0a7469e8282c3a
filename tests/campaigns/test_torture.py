"""SIGKILL at 20 random moments of saves, partial saves, merges, commits, delete_step and gc,
on local disk and moto's S3, by one process and by two, every such cell at least once
(tests/campaigns/torture.py; `make torture` runs the full campaign of 300 and more)."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from ckptstore.testing.servers import MotoS3Server
from tests.campaigns.torture import CELLS, moto_env, s3_profile, torture
from tests.campaigns.torture_report import table

POINTS = 20


@pytest.mark.slow
def test_twenty_kills_lose_and_tear_no_committed_step(
    ckptstore_s3_server: MotoS3Server,
    ckptstore_s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed = int(os.environ.get("CKPTSTORE_TORTURE_SEED") or random.SystemRandom().randrange(2**32))
    env = moto_env(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    targets = {
        "local": str(tmp_path / "local"),
        "s3": s3_profile(tmp_path, ckptstore_s3_server.endpoint, ckptstore_s3_bucket, "torture"),
    }
    lines: list[str] = []
    report, points = asyncio.run(
        torture(
            targets,
            points=POINTS,
            seed=seed,
            env=env,
            log=lines.append,
            worker_log=tmp_path / "workers.log",
            keep=2,
            # No weights: the deck holds every (operation, processes, backend) cell once,
            # so its first 20 kills, landed or not, hit each (S3 on moto costs ~4x a local point).
            cells=CELLS,  # the incremental ones: tests/campaigns/test_torture_incremental.py
        )
    )
    print("\n".join([*lines, table(report)]))
    rerun = f"rerun with CKPTSTORE_TORTURE_SEED={seed}"
    bad = [p for p in points if p.lost or p.torn or p.problems]
    assert not bad, f"{rerun}:\n" + "\n".join(str(p) for p in bad)
    total = report["total"]
    assert total["kill_points"] >= POINTS and total["committed_lost"] == 0, rerun
    assert total["committed_torn"] == 0, rerun
    # Every (operation, processes, backend) cell was killed, most of them mid-operation.
    assert len({(p.op, p.processes, p.backend) for p in points}) == 2 * len(CELLS), rerun
    assert len({(p.op, p.processes, p.backend) for p in points if p.in_op}) >= len(CELLS), rerun
