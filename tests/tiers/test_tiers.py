"""Tiered storage: promotion from a fast tier to a durable one (moto S3, fake-gcs-server),
resumption after SIGKILL, restores from the nearest good copy, fast-tier retention."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.checkpoint.target import open_target, opened
from ckptstore.cli import main
from ckptstore.tiers import status as tier_status
from tests.checkpoint.helpers import shared_target
from tests.paths import committed_root, largest_data_file
from tests.tiers.helpers import assert_tree, tree

DURABLE = ["s3", "gcs"]
#: SIGKILLs of the promoter per durable backend (CKPTSTORE_PROMOTE_KILLS=50 for the long run).
#: 3 here: with the seeded choices each backend's include a kill at the last object left
#: and kills of resumed promotions (6 before; the later ones repeated early kills).
KILLS = int(os.environ.get("CKPTSTORE_PROMOTE_KILLS", "3"))


@pytest.fixture(params=DURABLE)
def tiered(request: pytest.FixtureRequest, tmp_path: Path) -> ckptstore.Tiered:
    durable = shared_target(request.param, request, tmp_path, "durable")
    return ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=durable)


async def test_promote_then_restore_from_either_tier(tiered: ckptstore.Tiered) -> None:
    for step in (1, 2):
        await ckptstore.save(tiered.fast, tree(step), step=step)
    assert (await tier_status.status(tiered)).unpromoted == [1, 2]
    done = await ckptstore.promote(tiered)
    assert [(p.step, p.already) for p in done] == [(1, False), (2, False)]
    assert all(p.copied == p.objects > 0 for p in done)
    assert await ckptstore.list_steps(tiered.durable) == [1, 2]
    assert (await tier_status.status(tiered)).steps == {1: "both", 2: "both"}
    assert (await ckptstore.verify(tiered.durable, step=2)).ok
    again = await ckptstore.promote(tiered, step=2)  # idempotent
    assert again[0].already and again[0].copied == 0
    assert_tree(await ckptstore.restore(tiered), 2)
    shutil.rmtree(tiered.fast)  # the job moved to new machines: the fast tier is empty
    assert await ckptstore.list_steps(tiered) == [1, 2]
    assert_tree(await ckptstore.restore(tiered, step=1), 1)
    assert_tree(await ckptstore.restore(tiered), 2)


async def test_a_damaged_fast_copy_falls_back_to_the_durable_one(
    tiered: ckptstore.Tiered, caplog: pytest.LogCaptureFixture
) -> None:
    await ckptstore.save(tiered.fast, tree(3), step=3)
    await ckptstore.promote(tiered)
    fast = ckptstore.open_backend(tiered.fast)
    root = await committed_root(fast, 3)
    data = largest_data_file(Path(tiered.fast, root, "state"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data.write_bytes(bytes(blob))
    with pytest.raises(ckptstore.CorruptCheckpointError):
        await ckptstore.restore(tiered.fast)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert_tree(await ckptstore.restore(tiered), 3)
    assert "fast copy of step 3 is damaged" in caplog.text


async def test_a_damaged_fast_copy_is_never_promoted_nor_trimmed(
    tiered: ckptstore.Tiered,
) -> None:
    """A same-size one-byte flip in a fast data file: promotion refuses (typed, naming the
    damage), the durable tier lists nothing, and keep_fast keeps the only copy."""
    trimmed = ckptstore.Tiered(tiered.fast, tiered.durable, keep_fast=1)
    for step in (1, 2):
        await ckptstore.save(trimmed.fast, tree(step), step=step)
    root = await committed_root(ckptstore.open_backend(trimmed.fast), 1)
    data = largest_data_file(Path(trimmed.fast, root, "state"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data.write_bytes(bytes(blob))
    with pytest.raises(ckptstore.CorruptCheckpointError, match="damaged on the fast tier"):
        await ckptstore.promote(trimmed)
    assert await ckptstore.list_steps(trimmed.durable) == []
    assert await ckptstore.list_steps(trimmed.fast) == [1, 2]
    assert_tree(await ckptstore.restore(trimmed.fast, step=2), 2)
    await ckptstore.promote(trimmed, step=2)  # the intact step still goes
    assert await ckptstore.list_steps(trimmed.durable) == [2]
    assert await ckptstore.list_steps(trimmed.fast) == [1, 2]  # 1 is the only copy of 1


async def test_keep_fast_trims_only_promoted_steps(tiered: ckptstore.Tiered) -> None:
    trimmed = ckptstore.Tiered(tiered.fast, tiered.durable, keep_fast=1)
    for step in (1, 2, 3):
        await ckptstore.save(trimmed.fast, tree(step), step=step)
    await ckptstore.promote(trimmed, step=1)  # 2 and 3 are not durable yet: stay
    assert await ckptstore.list_steps(trimmed.fast) == [2, 3]
    await ckptstore.promote(trimmed)
    assert await ckptstore.list_steps(trimmed.fast) == [3]
    assert await ckptstore.list_steps(trimmed.durable) == [1, 2, 3]


async def test_durable_tier_with_another_attempt_is_refused(tiered: ckptstore.Tiered) -> None:
    await ckptstore.save(tiered.fast, tree(4), step=4)
    await ckptstore.save(tiered.durable, tree(5), step=4)  # someone else's step 4
    with pytest.raises(ckptstore.AlreadyExistsError, match="another attempt"):
        await ckptstore.promote(tiered)
    assert_tree(await ckptstore.restore(tiered.durable), 5)  # untouched


KILLED_PROMOTER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import ckptstore
    from ckptstore.testing.faults import FaultyBackend

    fast, durable, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class DiesMidPromotion(FaultyBackend):
        writes = 0

        async def _write(self, key, data):
            DiesMidPromotion.writes += 1
            if DiesMidPromotion.writes == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            await super()._write(key, data)

        async def _create(self, key, data):
            if kill_at == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            await super()._create(key, data)

    inner = ckptstore.open_backend(profile=durable) if durable.endswith(".toml") else (
        ckptstore.open_backend(durable))
    asyncio.run(ckptstore.promote(ckptstore.Tiered(fast, DiesMidPromotion(inner))))
    print("finished without being killed")
    """
)


@pytest.mark.parametrize("kind", DURABLE)
async def test_a_killed_promotion_resumes_and_never_shows_early(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    durable = shared_target(kind, request, tmp_path, "durable")
    fast = str(tmp_path / "nvme")
    for step in (1, 2):
        await ckptstore.save(fast, tree(step), step=step)
    fast_backend, durable_backend = ckptstore.open_backend(fast), open_target(durable)
    objects = {  # what a promotion copies: each tier keeps its own fate records
        i.key: i.size
        async for i in fast_backend.list()
        if "COMMITTED" not in i.key and not i.key.endswith("/FATE")
    }
    rng = random.Random(kind)
    kills = 0
    while kills < KILLS:
        landed = {i.key: i.size async for i in durable_backend.list()}
        remaining = sum(landed.get(k) != size for k, size in objects.items())
        k = rng.randint(1, remaining) if remaining else 0  # 0: at a commit marker
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", KILLED_PROMOTER, fast, durable, str(k)],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGKILL, (k, proc.stdout, proc.stderr[-2000:])
        kills += 1
        listed = await ckptstore.list_steps(durable)
        for step in listed:  # whatever is listed is whole
            assert (await ckptstore.verify(durable, step=step)).ok
        assert len(listed) < 2  # killed before the last marker
        if not remaining:  # killed at the last marker: start over from an empty durable tier
            for key in [i.key async for i in durable_backend.list()]:
                await durable_backend.delete(key)
    await durable_backend.close()
    print(f"{kind}: {kills} promoters killed, none left a step listed early")
    done = await ckptstore.promote(ckptstore.Tiered(fast, durable))
    assert sum(p.copied for p in done) <= len(objects)
    assert await ckptstore.list_steps(durable) == [1, 2]
    for step in (1, 2):
        assert_tree(await ckptstore.restore(durable, step=step), step)


def test_cli_promote_from_a_tiers_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    ckptstore.save_sync(str(fast), tree(7), step=7)
    profile = tmp_path / "tiered.toml"
    profile.write_text(f'[tiers]\nfast = "{fast}"\ndurable = "{durable}"\n')
    assert main(["promote", str(profile), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "step 7: copied" in out and "durable now: [7]" in out
    assert main(["promote", str(profile), "--no-progress"]) == 0
    assert "durable now: [7]" in capsys.readouterr().out
    ckptstore.save_sync(str(fast), tree(8), step=8)
    assert main(["ls", str(profile)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["7", "8"]
    assert "fast + durable" in lines[1] and "fast only, not promoted yet" in lines[2]
    assert lines[3].startswith("promotion lag: 1 step not durable yet, the oldest saved")
    with pytest.raises(ckptstore.ConfigError, match="two tiers"):
        ckptstore.open_backend(profile=str(profile))


def test_manager_saves_fast_and_promotes_in_the_background(tiered: ckptstore.Tiered) -> None:
    tiers_ = ckptstore.Tiered(tiered.fast, tiered.durable, keep_fast=1)
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    keep = ckptstore.policies.KeepLatest(2)
    with ckptstore.CheckpointManager(tiers_, keep_policy=keep, options=opts) as mgr:
        for step in range(1, 5):
            handle = mgr.save(step, tree(step))
            assert handle is not None
            handle.wait()  # committed on the fast tier
            assert step in ckptstore.list_steps_sync(tiers_.fast)
        mgr.wait_until_finished()  # and promoted, and the keep policies applied
        assert ckptstore.list_steps_sync(tiers_.durable) == [3, 4]
        assert ckptstore.list_steps_sync(tiers_.fast) == [4]
        assert mgr.all_steps() == [3, 4]
        assert_tree(mgr.restore(3), 3)  # from the durable tier: the fast one dropped it
    shutil.rmtree(tiers_.fast)  # a restart on new machines
    with ckptstore.CheckpointManager(tiers_, keep_policy=keep, options=opts) as mgr:
        assert mgr.latest_step() == 4
        assert_tree(mgr.restore(), 4)


def tiers_profile(tmp_path: Path, durable: str) -> Path:
    profile = tmp_path / "tiered.toml"
    profile.write_text(f'[tiers]\nfast = "{tmp_path / "nvme"}"\ndurable = "{durable}"\n')
    return profile


class Output:
    """A subprocess's stream, read on a thread as it comes (progress lines end in \\r)."""

    def __init__(self, stream: Any) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        while chunk := stream.read(1):
            self.text += chunk

    def wait_for(self, needle: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert time.monotonic() < deadline, f"no {needle!r} in {self.text!r}"
            time.sleep(0.05)

    def done(self) -> str:
        self._thread.join(timeout=30)
        return self.text


Started = tuple["subprocess.Popen[str]", Output, Output]


def start_cli(*args: str, script: str | None = None) -> Started:
    command = ["-c", script] if script else ["-m", "ckptstore.cli"]
    proc = subprocess.Popen(
        [sys.executable, *command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    return proc, Output(proc.stdout), Output(proc.stderr)


async def wait_durable(durable: str, steps: list[int], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while (listed := await ckptstore.list_steps(durable)) != steps:
        assert time.monotonic() < deadline, f"durable tier lists {listed}, not {steps}"
        await asyncio.sleep(0.1)


async def test_promote_watch_promotes_each_new_step_until_sigterm(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A real ``ckptstore promote --watch`` process: each step saved to the fast tier while
    it runs becomes durable on moto S3, with its progress shown; SIGTERM stops it, status 0."""
    durable = shared_target("s3", request, tmp_path, "durable")
    profile = tiers_profile(tmp_path, durable)
    proc, out, err = start_cli(
        "promote", str(profile), "--watch", "--interval", "0.2", "--progress"
    )
    try:
        out.wait_for("SIGINT or SIGTERM stops")
        for step in (1, 2):
            await ckptstore.save(str(tmp_path / "nvme"), tree(step), step=step)
            await wait_durable(durable, list(range(1, step + 1)))
            out.wait_for(f"step {step}: copied")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, err.done()[-3000:]
    finally:
        proc.kill()
    lines = out.done().splitlines()
    assert lines[-2:] == ["durable now: [1, 2]", "stopped by SIGTERM"], lines
    assert "step 2: " in err.done() and "(100%)" in err.text  # the progress line
    for step in (1, 2):
        assert_tree(await ckptstore.restore(durable, step=step), step)


SLOW_PROMOTER = textwrap.dedent(
    """
    import sys
    from ckptstore.cli import main
    from ckptstore.tiers import promote as tiers
    from ckptstore.testing.faults import FaultyBackend

    real_copy = tiers.copy_objects

    async def slow_copy(fast, durable, objects, root, result, max_bytes_in_flight, progress):
        # one object at a time, each 0.3 s late: a SIGTERM lands mid-promotion
        slow = FaultyBackend(durable, latency=0.3)
        await real_copy(fast, slow, objects, root, result, 1, progress)

    tiers.copy_objects = slow_copy
    sys.exit(main(sys.argv[1:]))
    """
)


async def test_sigterm_mid_promotion_leaves_a_resumable_unlisted_step(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM while ``promote --watch`` uploads a step to moto S3 (slowed: one object at a
    time): it stops with status 0, the step is not listed, and promoting again resumes."""
    durable = shared_target("s3", request, tmp_path, "durable")
    profile = tiers_profile(tmp_path, durable)
    await ckptstore.save(str(tmp_path / "nvme"), tree(3), step=3)
    async with opened(str(tmp_path / "nvme")) as fast:
        objects = [
            i.key async for i in fast.list("3/") if not i.key.endswith(("COMMITTED", "FATE"))
        ]
    proc, out, err = start_cli(
        "promote", str(profile), "--watch", "--interval", "0.2", "--progress", script=SLOW_PROMOTER
    )
    try:
        err.wait_for("step 3: ")  # an object landed, more to come
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, err.done()[-3000:]
    finally:
        proc.kill()
    assert "step 3: interrupted, not durable" in out.done()
    assert await ckptstore.list_steps(durable) == []  # never listed early
    async with opened(durable) as backend:
        landed = [i.key async for i in backend.list("3/") if not i.key.endswith("/FATE")]
    assert 0 < len(landed) < len(objects)
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["promote", str(profile), "--no-progress"]) == 0
    resumed = f"step 3: copied {len(objects) - len(landed)} of {len(objects)} objects"
    assert resumed in capsys.readouterr().out
    assert await ckptstore.list_steps(durable) == [3]
    assert_tree(await ckptstore.restore(durable, step=3), 3)


def test_promote_watch_takes_no_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tiers_profile(tmp_path, str(tmp_path / "bucket"))
    assert main(["promote", str(profile), "--watch", "--step", "1"]) == 2
    assert "give no --step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["promote", str(profile), "--watch", "--interval", "soon"])
    assert "--interval: not a duration" in capsys.readouterr().err


async def test_ls_shows_each_steps_tiers_and_how_far_promotion_got(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    durable = tmp_path / "bucket"
    profile = tiers_profile(tmp_path, str(durable))
    tiered = ckptstore.Tiered.from_profile(profile)
    for step in (1, 2, 3):
        await ckptstore.save(tiered.fast, tree(step), step=step)
    await ckptstore.promote(tiered)
    await ckptstore.save(tiered.fast, tree(4), step=4)
    await ckptstore.delete_step(tiered.fast, 1)  # trimmed from the fast tier
    # Step 3: as a promotion cut short leaves it (the marker and one data file not there).
    (durable / "3" / "COMMITTED").unlink()
    largest_data_file(durable / "3").unlink()
    assert await asyncio.to_thread(main, ["ls", str(profile)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "TIERS"]
    assert lines[1].split(None, 1) == ["1", "durable only"]
    assert lines[2].split(None, 1) == ["2", "fast + durable"]
    step3 = lines[3].split(None, 1)[1]
    assert step3.startswith("fast only, promoting: ") and step3.endswith("% on the durable tier")
    assert 0 < int(step3.split(": ")[1].split("%")[0]) < 100
    assert lines[4].split(None, 1) == ["4", "fast only, not promoted yet"]
    assert lines[5].startswith("promotion lag: 2 steps not durable yet, the oldest saved")
    assert await asyncio.to_thread(main, ["ls", str(profile), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == {"1": "durable", "2": "both", "3": "fast", "4": "fast"}
    assert 0 < doc["uploaded"]["3"] < 1 and doc["uploaded"]["4"] == 0
    assert doc["unpromoted"] == [3, 4] and 0 <= doc["lag_seconds"] < 600
    await ckptstore.promote(tiered)  # resumes step 3
    assert await asyncio.to_thread(main, ["ls", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "promotion lag: none" in out and "fast only" not in out


def test_a_restarted_manager_finishes_what_its_predecessor_left(tmp_path: Path) -> None:
    """A run killed before its promotions left steps 1-5 on the fast tier only: a new
    manager promotes them in the background, then applies its keep policy on both tiers."""
    tiers = ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=str(tmp_path / "bucket"))
    for step in range(1, 6):
        ckptstore.save_sync(tiers.fast, tree(step), step=step)  # committed, never promoted
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    keep = ckptstore.policies.KeepLatest(3)
    with ckptstore.CheckpointManager(tiers, keep_policy=keep, options=opts) as mgr:
        mgr.wait_until_finished()
        assert mgr.resumed_promotions == [1, 2, 3, 4, 5]
        assert mgr.all_steps() == [3, 4, 5]
    assert ckptstore.list_steps_sync(tiers.durable) == [3, 4, 5]
    assert ckptstore.list_steps_sync(tiers.fast) == [3, 4, 5]
    for step in (3, 4, 5):
        assert_tree(ckptstore.restore_sync(tiers.durable, step=step), step)
