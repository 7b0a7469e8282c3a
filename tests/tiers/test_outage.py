"""A tiered manager keeps saving to its fast tier while the durable tier is down, keeps its
keep policy there, opens anew during the outage, and the durable tier catches up once it
answers again. The durable tier is moto's S3 server behind a `FaultProxy` (503s to every
request, connections dropped, or a black hole)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.s3 import S3Backend
from ckptstore.testing.faultproxy import Fault, FaultProxy
from tests.tiers.helpers import impatient_s3

#: Seconds one save may take while the durable tier is down (generous: a loaded machine).
BOUND = 15.0


def tree(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(4096, float(step), np.float32), "b": np.arange(step, step + 8)}


@pytest.mark.parametrize(
    "fault",
    [Fault("status", rate=1.0), Fault("drop", rate=1.0), Fault("blackhole", rate=1.0)],
    ids=["503", "dropped", "blackhole"],
)
def test_saves_go_on_through_an_outage_and_the_durable_tier_catches_up(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str, fault: Fault
) -> None:
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    fast = str(tmp_path / "nvme")
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    keep = ckptstore.policies.KeepLatest(3)
    with FaultProxy(endpoint) as proxy:
        durable = impatient_s3(ckptstore_s3_bucket, proxy.endpoint)
        tiered = ckptstore.Tiered(fast=fast, durable=durable)
        mgr = ckptstore.CheckpointManager(tiered, keep_policy=keep, options=options)
        try:
            for step in (1, 2):
                mgr.save(step, tree(step), force=True).wait()  # type: ignore[union-attr]
            mgr.wait_until_finished()
            assert ckptstore.list_steps_sync(durable) == [1, 2]

            proxy.set_faults(fault)  # the durable tier goes away
            for step in range(3, 8):
                start = time.monotonic()
                handle = mgr.save(step, tree(step), force=True)
                assert handle is not None
                handle.wait()
                assert time.monotonic() - start < BOUND
            mgr.wait_until_finished()  # the keep policy ran on the fast tier: no error
            assert proxy.injected[fault.kind] > 0
            assert ckptstore.list_steps_sync(fast) == [5, 6, 7]
            assert {5, 6, 7} <= mgr.unpromoted
            lagging = mgr.save(8, tree(8), force=True).wait()  # type: ignore[union-attr]
            assert {5, 6, 7} <= set(lagging.unpromoted)  # what a metrics logger sees
            mgr.wait_until_finished()

            # A restart while it is down opens, and lists what the fast tier holds.
            again = ckptstore.CheckpointManager(tiered, keep_policy=keep, options=options)
            assert again.all_steps() == [6, 7, 8]
            np.testing.assert_array_equal(again.restore()["w"], tree(8)["w"])  # the latest
            np.testing.assert_array_equal(ckptstore.restore_sync(tiered)["w"], tree(8)["w"])
            again.close()

            proxy.set_faults()  # it is back: the next save's turn promotes what waits
            mgr.save(9, tree(9), force=True).wait()  # type: ignore[union-attr]
            mgr.wait_until_finished()
            assert not mgr.unpromoted
        finally:
            proxy.set_faults()
            mgr.close()
    direct = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    assert ckptstore.list_steps_sync(direct) == [7, 8, 9]
    assert ckptstore.list_steps_sync(fast) == [7, 8, 9]
    for step in (7, 8, 9):
        got = ckptstore.restore_sync(direct, step)
        np.testing.assert_array_equal(got["w"], tree(step)["w"])
        np.testing.assert_array_equal(got["b"], tree(step)["b"])
    assert ckptstore.verify_sync(direct, 8).ok


def test_closing_after_the_outage_promotes_what_waits(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    with FaultProxy(endpoint) as proxy:
        durable = impatient_s3(ckptstore_s3_bucket, proxy.endpoint)
        tiered = ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=durable)
        options = ckptstore.ManagerOptions(handle_sigterm=False)
        mgr = ckptstore.CheckpointManager(tiered, options=options)
        proxy.set_faults(Fault("status", rate=1.0))
        for step in (1, 2):
            mgr.save(step, tree(step), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()
        assert mgr.unpromoted == {1, 2}
        proxy.set_faults()
        mgr.close()
    direct = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    assert ckptstore.list_steps_sync(direct) == [1, 2]


def test_ls_of_a_profile_lists_the_fast_tier_while_the_durable_one_is_down(
    tmp_path: Path,
    ckptstore_s3_server: object,
    ckptstore_s3_bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ckptstore ls PROFILE`: each step on the fast tier, the promotion lag, the durable
    tier's error, exit 3 (the storage failed), never a traceback."""
    import json

    from ckptstore.cli.main import main

    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    fast = tmp_path / "nvme"
    with FaultProxy(endpoint) as proxy:
        durable = tmp_path / "durable.toml"
        durable.write_text(
            f'url = "s3://{ckptstore_s3_bucket}/run"\n[options]\nendpoint = "{proxy.endpoint}"\n'
            'credentials = "env"\nconnect_timeout = 0.5\nread_timeout = 0.5\n'
            "[options.retry]\nmax_attempts = 2\nbase_delay = 0.01\nmax_delay = 0.05\n"
        )
        profile = tmp_path / "tiers.toml"
        profile.write_text(f'[tiers]\nfast = "{fast}"\ndurable = "{durable}"\n')
        ckptstore.save_sync(str(fast), tree(1), step=1)
        assert main(["ls", str(profile), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["unpromoted"] == [1]

        proxy.set_faults(Fault("status", rate=1.0))
        assert main(["ls", str(profile)]) == 3
        out = capsys.readouterr().out
        assert "the durable tier does not answer" in out
        assert "fast only" in out and "promotion lag: 1 step not durable yet" in out
        assert main(["ls", str(profile), "--json"]) == 3
        doc = json.loads(capsys.readouterr().out)
        assert doc["steps"] == {"1": "fast"} and doc["unpromoted"] == [1]
        assert doc["durable_error"] and doc["lag_seconds"] >= 0


OUTAGE_WORKER = """
import json, os, signal, sys
import numpy as np
import ckptstore
from tests.tiers.helpers import impatient_s3
from tests.tiers.test_outage import tree

fast, bucket, endpoint = sys.argv[1:4]
tiered = ckptstore.Tiered(fast=fast, durable=impatient_s3(bucket, endpoint))
options = ckptstore.ManagerOptions(handle_sigterm=False)
mgr = ckptstore.CheckpointManager(tiered, options=options)
for step in range(1, 6):
    stats = mgr.save(step, tree(step), force=True).wait()
    print(json.dumps({"step": step, "unpromoted": list(stats.unpromoted)}), flush=True)
mgr.save(6, tree(6), force=True)  # in flight when the job dies
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_job_killed_during_an_outage_is_caught_up_by_its_successor(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    """SIGKILL while the durable tier is down, one save in flight: the fast tier holds
    what was committed; once the durable tier is back, the next manager on these tiers
    promotes all of it, each step bit-exact there."""
    import json
    import signal
    import subprocess
    import sys

    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    fast = str(tmp_path / "nvme")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with FaultProxy(endpoint) as proxy:
        proxy.set_faults(Fault("drop", rate=1.0))  # down from the start
        argv = [sys.executable, "-c", OUTAGE_WORKER, fast, ckptstore_s3_bucket, proxy.endpoint]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
        assert lines[-1]["unpromoted"][:3] == [1, 2, 3]  # the lag, as each save saw it
        committed = ckptstore.list_steps_sync(fast)
        assert committed[:5] == [1, 2, 3, 4, 5] and set(committed) <= {1, 2, 3, 4, 5, 6}

        proxy.set_faults()  # back
        durable = impatient_s3(ckptstore_s3_bucket, proxy.endpoint)
        tiered = ckptstore.Tiered(fast=fast, durable=durable)
        options = ckptstore.ManagerOptions(handle_sigterm=False)
        with ckptstore.CheckpointManager(tiered, options=options) as successor:
            successor.wait_until_finished()
            assert successor.resumed_promotions == committed
    direct = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    assert ckptstore.list_steps_sync(direct) == committed
    for step in committed:
        got = ckptstore.restore_sync(direct, step)
        np.testing.assert_array_equal(got["w"], tree(step)["w"])
        np.testing.assert_array_equal(got["b"], tree(step)["b"])


def test_an_outage_between_promotion_and_keep_policy_leaves_it_to_the_fast_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The durable tier answers the promotion, then goes away while the keep policy
    deletes there: the fast tier is kept alone, no save fails, and the next save's turn
    applies the policy to both tiers (found by `make outage`)."""
    from ckptstore.errors import RetriesExhaustedError
    from ckptstore.lifecycle import retention

    real, failed = retention.delete_step, []

    async def durable_gone_once(target: object, step: int) -> object:
        if isinstance(target, ckptstore.Tiered) and not failed:
            failed.append(step)
            raise RetriesExhaustedError("gave up after 2 attempts: the durable tier is down")
        return await real(target, step)  # type: ignore[arg-type]

    monkeypatch.setattr(retention, "delete_step", durable_gone_once)
    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    tiered = ckptstore.Tiered(fast=str(fast), durable=str(durable))
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    keep = ckptstore.policies.KeepLatest(2)
    with ckptstore.CheckpointManager(tiered, keep_policy=keep, options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, tree(step), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()  # the keep policy after step 3 met the outage: no error
        assert failed == [1]
        assert ckptstore.list_steps_sync(str(fast)) == [2, 3]
        assert ckptstore.list_steps_sync(str(durable)) == [1, 2, 3]
        mgr.save(4, tree(4), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()
    assert ckptstore.list_steps_sync(str(fast)) == [3, 4]
    assert ckptstore.list_steps_sync(str(durable)) == [3, 4]
