"""Two real JAX processes keep saving to their fast tier while the durable tier (moto's S3
server behind a `FaultProxy`) answers 503 to everything, and it catches up once it is back:
promotion is collective, so every process learns that it failed and defers it alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.s3 import S3Backend
from ckptstore.testing.faultproxy import Fault, FaultProxy
from ckptstore.testing.servers import free_port

WORKER = "tests.multiprocess.outage_worker"
ROOT = Path(__file__).parents[2]


def say(procs: list[subprocess.Popen[str]], line: str) -> list[str]:
    """Send ``line`` to every worker (none for the first read); what each prints next."""
    if line:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
    return [proc.stdout.readline().strip() for proc in procs if proc.stdout is not None]


@pytest.mark.parametrize(
    ("fast", "waiting", "reopened"),
    # A shared fast tier holds committed steps: the keep policy applies to it alone, and a
    # restart lists them. Each host's own fast tier holds staged parts, which all wait for
    # their promotion; a restart lists the newest, and reads it from each host's own copy.
    [("own", [3, 4, 5, 6, 7], [7]), ("shared", [5, 6, 7], [5, 6, 7])],
)
@pytest.mark.slow
def test_two_processes_save_through_an_outage_of_the_durable_tier(
    tmp_path: Path,
    ckptstore_s3_server: object,
    ckptstore_s3_bucket: str,
    fast: str,
    waiting: list[int],
    reopened: list[int],
) -> None:
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    coordinator = f"127.0.0.1:{free_port()}"
    with FaultProxy(endpoint) as proxy:
        args = [str(tmp_path), proxy.endpoint, ckptstore_s3_bucket, fast]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", WORKER, coordinator, "2", str(i), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=(tmp_path / f"{i}.err").open("w"),
                text=True,
                cwd=ROOT,
            )
            for i in range(2)
        ]
        try:
            assert say(procs, "") == ["up", "up"], errors(tmp_path)
            proxy.set_faults(Fault("status", rate=1.0))  # the durable tier goes away
            down = say(procs, "go")
            assert proxy.injected["status"] > 0
            proxy.set_faults()  # it is back
            back = say(procs, "go")
            for i, proc in enumerate(procs):
                assert proc.wait(timeout=120) == 0, f"process {i}:\n{errors(tmp_path)}"
        finally:
            proxy.set_faults()
            for proc in procs:
                proc.kill()
    # While it was down every save committed (or, own fast tiers, staged) on the fast
    # tier, the steps kept waited for the durable tier, and a restart listed what it saw.
    assert down == [f"down unpromoted {waiting} reopened {reopened} restored 7"] * 2, down
    if fast == "own":
        for i in range(2):
            assert "step 7 read from this host's fast copy" in (tmp_path / f"{i}.err").read_text()
    assert back == ["back unpromoted [] steps [6, 7, 8]"] * 2, back
    direct = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    assert ckptstore.list_steps_sync(direct) == [6, 7, 8]
    assert ckptstore.verify_sync(direct, 8).ok


def test_a_durable_tier_answering_one_process_only_refuses_a_committed_step_on_both(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    """Whether the step is committed is process 0's answer for every process: process 1,
    whose durable tier does not answer, would otherwise go into the save alone and wait for
    process 0 until the manager's timeout."""
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    direct = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    ckptstore.save_sync(direct, {"w": np.zeros(64, np.float32)}, step=5)
    args = [str(tmp_path), endpoint, ckptstore_s3_bucket]
    assert run(args, "split", tmp_path) == ["refused: AlreadyExistsError\n"] * 2


def test_a_step_staged_by_some_processes_only_is_neither_listed_nor_promoted(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    """Each host's own fast tier, the durable tier down: steps 1-3 are staged; then process
    1's record of step 3 is gone (killed before it staged it). The restarted job, the
    durable tier back, resumes from step 2, and promotes 1 and 2 beside its new step 4."""
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    args = [str(tmp_path), endpoint, ckptstore_s3_bucket]
    assert run(args, "stage", tmp_path) == ["staged, unpromoted [1, 2, 3]\n"] * 2
    (tmp_path / "fast1" / "3" / "STAGED").unlink()
    assert run(args, "resume", tmp_path) == ["resumed [2], then [1, 2, 4]\n"] * 2
    said = (tmp_path / "0.err").read_text()  # process 0 decides what is staged everywhere
    assert "steps [3] are staged on process 0's fast tier but not by every" in said
    direct = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    assert ckptstore.list_steps_sync(direct) == [1, 2, 4]


def test_a_damaged_staged_manifest_never_stops_a_manager_from_opening(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    """Each host's own fast tier, the durable tier down: steps 1-3 staged, then process 0's
    manifest of step 3 damaged. A manager opens (it raised `CorruptCheckpointError`) and
    lists nothing it cannot read: step 3 waits for its promotion."""
    args = [str(tmp_path), ckptstore_s3_server.endpoint, ckptstore_s3_bucket]  # type: ignore[attr-defined]
    assert run(args, "stage", tmp_path) == ["staged, unpromoted [1, 2, 3]\n"] * 2
    (manifest,) = (tmp_path / "fast0" / "3").glob("*/manifest.json")
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"steb"'))
    assert run(args, "open", tmp_path) == ["opened, listed []\n"] * 2
    said = (tmp_path / "1.err").read_text()  # process 1 learnt process 0's failure
    assert "staged step 3 is not listed before its promotion" in said


def test_the_others_wait_for_a_promotion_longer_than_the_timeout(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    """Process 0 promotes for both (one shared fast tier) and its durable marker takes 8 s
    to write, past the manager's 5 s timeout: process 1 waits while process 0 works (it
    beats), where it gave up with `CoordinationError` at the timeout."""
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    slow = Fault("latency", rate=1.0, delay=8.0, methods=("PUT",), path="COMMITTED")
    with FaultProxy(endpoint, faults=[slow]) as proxy:
        args = [str(tmp_path), proxy.endpoint, ckptstore_s3_bucket]
        assert run(args, "slow", tmp_path) == ["promoted, listed [1]\n"] * 2
        assert proxy.injected["latency"] == 1


def run(args: list[str], mode: str, tmp_path: Path) -> list[str]:
    """Two workers in ``mode`` (the FAST argument); what each printed."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER, coordinator, "2", str(i), *args, mode],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"{i}.err").open("w"),
            text=True,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), errors(tmp_path)
    return outputs


def errors(tmp_path: Path) -> str:
    return "\n".join((tmp_path / f"{i}.err").read_text()[-3000:] for i in range(2))
