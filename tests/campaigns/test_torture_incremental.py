"""SIGKILL inside incremental saves (tests/campaigns/torture.py, `INCREMENTAL_CELLS`): saves
with ``base=`` (a table among their leaves changed in two chunks, written as raw keys, the
rest referenced) killed at random moments and at exact points (after the base is read, after
the agreement round, after the writes, the merge, the manifest, and the re-check of the
base before the marker), deletions of a step later steps reference killed midway, and an
incremental save racing the deletion of its base and a gc with a tiny grace, one of the
three killed; and a save stopped at an exact point while its base (holding the bytes
itself) is deleted and a gc runs, then resumed or killed. On local disk (`make torture`
runs them on S3 too).

The paused save is what makes this test fail when the protocol breaks: with the re-check
of the base before the marker removed (`protocol.check_base` returning at once), a save
paused before its manifest while its base is deleted commits a step whose bytes are gone
(torn, failing verify and the reference check). It runs twice per deck here."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

from tests.campaigns.torture import INCREMENTAL_CELLS, torture
from tests.campaigns.torture_report import table

POINTS = 10


def test_kills_inside_incremental_saves_lose_no_referenced_bytes(tmp_path: Path) -> None:
    seed = int(os.environ.get("CKPTSTORE_TORTURE_SEED") or random.SystemRandom().randrange(2**32))
    lines: list[str] = []
    report, points = asyncio.run(
        torture(
            {"local": str(tmp_path / "local")},
            points=POINTS,
            seed=seed,
            env={},
            log=lines.append,
            worker_log=tmp_path / "workers.log",
            keep=2,
            cells=[*INCREMENTAL_CELLS, ("pause", 1)],
        )
    )
    print("\n".join([*lines, table(report)]))
    rerun = f"rerun with CKPTSTORE_TORTURE_SEED={seed}"
    bad = [p for p in points if p.lost or p.torn or p.problems]
    assert not bad, f"{rerun}:\n" + "\n".join(str(p) for p in bad)
    total = report["total"]
    assert total["kill_points"] >= POINTS, rerun
    assert total["committed_lost"] == total["committed_torn"] == 0, rerun
    # Every incremental cell ran; committed steps read a deleted base's bytes after some
    # kills (the holder's own step is deleted while later steps reference it).
    assert {(p.op, p.processes) for p in points} == set(INCREMENTAL_CELLS), rerun
    assert total["points_with_a_deleted_base_held"] > 0, rerun
    # At the end every step was deleted, oldest first, and gc left nothing behind.
    final = report["final"]["local"]
    assert final["problems"] == [] and final["left"] == 0 and final["deleted"] > 0, rerun
