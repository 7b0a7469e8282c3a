"""Two real JAX processes joined by jax.distributed save one sharded tree."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.checkpoint.target import opened
from ckptstore.cli import main
from ckptstore.testing.servers import free_port
from ckptstore.tiers import status as tier_status
from tests.checkpoint.helpers import shared_target
from tests.multiprocess.mp_worker import SHAPES, expected
from tests.paths import a_day_later

WORKER = Path(__file__).with_name("mp_worker.py")


def run_job(
    root: Path, mode: str, num: int = 2, *extra: str, codes: Sequence[int] = ()
) -> list[str]:
    """Run ``num`` workers in ``mode``; their outputs. Each must exit with status 0, or
    with its entry of ``codes`` where given."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(num), str(i), str(root), mode, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=WORKER.parents[1],
        )
        for i in range(num)
    ]
    outputs = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=240)
        want = codes[i] if codes else 0
        assert proc.returncode == want, f"process {i} exited {proc.returncode}:\n{err[-3000:]}"
        outputs.append(out)
    return outputs


def test_two_processes_save_then_restore_anywhere(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    outputs = run_job(root, "save")
    written = [int(o.split()[1]) for o in outputs]
    total = int(outputs[0].split()[3])
    assert sum(written) == total  # every byte written once, replicas skipped
    assert all(w > 0 for w in written)

    # Each process wrote its own store; the merged one references both.
    (attempt,) = (root / "1").glob("attempt-*")
    assert sorted(p.name for p in (attempt / "state").glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    manifest = json.loads((attempt / "manifest.json").read_text())
    assert [p["process"] for p in manifest["processes"]] == [0, 1]

    # One process with 8 devices.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("d",))
    like = {
        k: jax.ShapeDtypeStruct(
            shape, np.float32, sharding=NamedSharding(mesh, P("d") if shape[0] % 8 == 0 else P())
        )
        for k, shape in SHAPES.items()
    }
    out = ckptstore.restore_sync(str(root), like=like)
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(out[k]), expected(k))

    # Two processes on a transposed mesh.
    assert run_job(root, "restore") == ["restored ok\n", "restored ok\n"]


def test_a_failing_process_fails_the_save_everywhere_quickly(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    start = time.monotonic()
    outputs = run_job(root, "fail")
    assert time.monotonic() - start < 50  # far below the 60 s coordination timeout
    assert outputs[1].startswith("failed: RuntimeError: disk on fire")
    assert outputs[0].startswith("failed: CkptStoreError: process 1 failed: RuntimeError: disk")
    assert ckptstore.list_steps_sync(str(root)) == []
    # Process 0 wrote its shards before it learned of the failure; once both processes had
    # reported, it removed the attempt (before, it stayed until gc, on a full disk too).
    left = [p for p in root.rglob("*") if p.is_file()]
    assert left == [], left


def test_when_process_0_fails_it_removes_the_attempt_once_the_other_has_written(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    outputs = run_job(root, "fail0")
    assert outputs[0].startswith("failed: RuntimeError: disk on fire"), outputs
    assert outputs[1].startswith("failed: CkptStoreError: save/1 failed on process 0"), outputs
    assert ckptstore.list_steps_sync(str(root)) == []
    left = [p for p in root.rglob("*") if p.is_file()]  # process 1's shards went too
    assert left == [], left


def test_when_a_process_dies_while_writing_nothing_is_committed_and_gc_takes_the_rest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    started = time.monotonic()
    outputs = run_job(root, "die", codes=(0, 3))
    assert outputs[1] == ""  # it died before saying anything
    # Typed, naming what it waited for: process 1's report of its writes.
    assert outputs[0].startswith("failed: CoordinationError: process 0: no value for "), outputs
    assert "/report/1/" in outputs[0], outputs
    # Its 8 s wait for process 1's report, then as long for the report a discard waits
    # for, then start-up: not a hang until some outer timeout.
    assert time.monotonic() - started < 120
    assert ckptstore.list_steps_sync(str(root)) == []
    # Process 1 may have been still writing as far as process 0 could tell: the attempt is
    # left (a discard must not pull it from under a silent writer), and gc takes it.
    (attempt,) = (root / "1").glob("attempt-*")
    assert any(p.is_file() for p in attempt.rglob("*"))
    removal = ckptstore.gc_sync(str(root), older_than=0)
    assert removal.entries and removal.objects > 0, removal
    with a_day_later():  # and, a day later, the collected attempt's tombstone
        ckptstore.gc_sync(str(root), older_than=0)
    assert [p for p in root.rglob("*") if p.is_file()] == []


def test_two_processes_build_a_step_from_partial_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert run_job(root, "partial") == ["partial ok\n", "partial ok\n"]
    (attempt,) = (root / "2").glob("attempt-*")
    stores = [p.name for p in (attempt / "state").glob("pending_*/ocdbt.process_*")]
    # Process 0 writes every part; process 1 only "w": of "v" and "replicated" it holds no
    # replica-0 shard (the mesh's first row, replica 0, is process 0's devices).
    assert sorted(stores) == ["ocdbt.process_0"] * len(SHAPES) + ["ocdbt.process_1"]
    manifest = json.loads((attempt / "manifest.json").read_text())
    assert len(manifest["processes"]) == 2 * len(SHAPES)
    out = ckptstore.restore_sync(str(root), step=2)
    for k in SHAPES:
        np.testing.assert_array_equal(out[k], expected(k))


@pytest.mark.slow
def test_losing_the_commit_is_already_exists_on_every_process(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    outputs = run_job(root, "late")
    assert all(o.startswith("failed: AlreadyExistsError") for o in outputs), outputs
    assert "committed by another writer first" in outputs[1]
    assert (root / "1" / "COMMITTED").read_bytes() == b'{"step": 1, "by": "someone else"}'
    # And a second job saving the committed step is refused by every process up front.
    shutil.rmtree(root)
    run_job(root, "save")
    assert all(o.startswith("failed: AlreadyExistsError") for o in run_job(root, "save"))


def test_two_processes_train_with_a_checkpoint_manager(tmp_path: Path) -> None:
    outputs = run_job(tmp_path / "ckpt", "manager")
    assert outputs == ["manager ok saved [1, 2, 4, 6]\n"] * 2  # step 1: the first save (clock)
    assert ckptstore.list_steps_sync(str(tmp_path / "ckpt")) == [4, 6]


def test_two_processes_orbax_out(tmp_path: Path) -> None:
    """Two ckptstore processes save; the export is restored by two Orbax processes."""
    run_job(tmp_path / "ckpt", "save")
    result = asyncio.run(ckptstore.export_orbax(tmp_path / "ckpt", tmp_path / "export"))
    assert result.linked > 0 and result.copied == 0
    mirrored = tmp_path / "export" / "ckptstore.state"
    assert sorted(p.name for p in mirrored.glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    outputs = run_job(tmp_path / "export", "orbax-restore")  # Gloo logs on stdout too
    assert all(o.endswith("orbax restored ok\n") for o in outputs), outputs


def test_two_processes_orbax_in(tmp_path: Path) -> None:
    """Two Orbax processes save; ckptstore reads it in place, and two processes import it."""
    root = tmp_path / "job"
    outputs = run_job(root / "orbax", "orbax-save")
    assert all(o.endswith("orbax saved\n") for o in outputs), outputs
    assert sorted(p.name for p in (root / "orbax").glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    in_place = ckptstore.restore_sync(str(root / "orbax"))
    for k in SHAPES:
        np.testing.assert_array_equal(in_place[k], expected(k))
    outputs = run_job(root, "orbax-import")
    assert all(o.endswith("imported 3 in 3 parts\n") for o in outputs), outputs
    imported = ckptstore.restore_sync(str(root / "imported"), step=1)
    for k in SHAPES:
        np.testing.assert_array_equal(imported[k], expected(k))
    assert ckptstore.verify_sync(str(root / "imported"), 1).ok


async def keys_of(target: str) -> list[str]:
    async with opened(target) as backend:
        return [info.key async for info in backend.list()]


async def undo_the_end_of_promotion(durable: str) -> None:
    """Leave the durable tier as a promoter killed before the marker would."""
    async with opened(durable) as backend:
        keys = [info.key async for info in backend.list("1/")]
        merged = [k for k in keys if "/state/" in k and "/ocdbt.process_" not in k]
        assert merged and "1/COMMITTED" in keys
        part = sorted(k for k in keys if "/ocdbt.process_1/d/" in k)[:1]
        for key in ["1/COMMITTED", *merged, *part]:
            await backend.delete(key)


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.slow
def test_two_hosts_with_their_own_fast_tiers_promote_and_merge_on_the_durable_tier(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each process's fast tier is its own directory (two 'hosts'); the step is staged
    there, promoted by both processes and merged by reference on the durable tier."""
    durable = shared_target(kind, request, tmp_path, "durable")
    outputs = run_job(tmp_path, "tiered-save", 2, durable)
    for out in outputs:
        refused, manager, saved = out.splitlines()
        assert refused.startswith("partial refused: partial_save of step 2: the fast tier")
        assert "is host-local" in refused and "ckptstore.save" in refused
        assert manager.startswith("manager refused: ManagerOptions(incremental=True) on tiers")
        assert "is host-local" in manager
        assert saved.startswith("tiered saved")
        assert saved.endswith("listed [] promoted [(1, True)] now [1]")
    for i in (0, 1):  # nothing of step 2 was written
        assert sorted(p.name for p in (tmp_path / f"fast{i}").iterdir()) == ["1"]
    # Each host: its own store, its STAGED marker and its host view, a store merged from its
    # own and (process 1) what else its devices held: every zarr.json, "v" and "replicated"
    # (replica 0 of those is on process 0's devices).
    for i, extra in ((0, []), (1, ["local.process_1"])):
        fast = tmp_path / f"fast{i}"
        (attempt,) = (fast / "1").glob("attempt-*")
        assert sorted(p.name for p in (attempt / "state").iterdir()) == sorted(
            ["d", "manifest.ocdbt", f"ocdbt.process_{i}", *extra]
        )
        assert (fast / "1" / "STAGED").is_file() and not (fast / "1" / "COMMITTED").exists()
        assert json.loads((fast / "1" / "STAGED").read_text())["host_view"] is True
    assert (tmp_path / "fast0" / "1" / attempt.name / "manifest.json").is_file()
    assert ckptstore.list_steps_sync(durable) == [1]
    assert ckptstore.verify_sync(durable, 1).ok
    assert not [k for k in asyncio.run(keys_of(durable)) if "/local.process_" in k]
    whole = ckptstore.restore_sync(durable)  # one process, the whole tree
    for k in SHAPES:
        assert whole[k].tobytes() == expected(k).tobytes()

    # A promotion killed before its durable marker (the merged store not written yet, one of
    # process 1's files not uploaded) resumes: only that file is copied, then merge, marker.
    asyncio.run(undo_the_end_of_promotion(durable))
    assert ckptstore.list_steps_sync(durable) == []
    host1 = ckptstore.Tiered(str(tmp_path / "fast1"), durable)
    before = asyncio.run(tier_status.status(host1))
    assert before.steps == {1: "staged"} and 0 < before.uploaded[1] < 1
    profile = tmp_path / "host1.toml"  # what `ckptstore ls` shows on host 1
    profile.write_text(f'[tiers]\nfast = "{tmp_path / "fast1"}"\ndurable = "{durable}"\n')
    assert main(["ls", str(profile)]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split(None, 1)[1].startswith("staged on this host")
    assert "% of this host's part on the durable tier" in row
    assert run_job(tmp_path, "tiered-promote", 2, durable) == [
        "promoted [(1, 0)]\n",
        "promoted [(1, 1)]\n",
    ]
    assert ckptstore.verify_sync(durable, 1).ok
    assert asyncio.run(tier_status.status(host1)).steps == {1: "both"}  # this host's copy + durable

    # A restart on the same two hosts: each process reads the slices its devices hold from
    # its own host's copy; the whole tree (more than a host holds) from the durable tier.
    # Then on new hosts (the fast directories gone): the durable tier for both.
    assert (
        run_job(tmp_path, "tiered-restore", 2, durable)
        == ["tiered restored ok: sharded this host's fast copy, whole the durable tier\n"] * 2
    )
    for i in (0, 1):
        shutil.rmtree(tmp_path / f"fast{i}")
    assert (
        run_job(tmp_path, "tiered-restore", 2, durable)
        == ["tiered restored ok: sharded the durable tier, whole the durable tier\n"] * 2
    )


def test_two_processes_sharing_one_fast_tier_commit_there(tmp_path: Path) -> None:
    """One host's NVMe seen by both processes: the step is merged and committed on the fast
    tier as usual, and process 0 alone promotes it."""
    durable = str(tmp_path / "durable")
    outputs = run_job(tmp_path, "tiered-save", 2, durable, "shared")
    assert outputs[0].endswith("listed [1] promoted [(1, True)] now [1]\n"), outputs
    assert outputs[1].endswith("listed [1] promoted [] now [1]\n"), outputs
    assert not list(tmp_path.glob("fast/.ckptstore-probe-*"))  # the probe is cleaned up
    assert ckptstore.list_steps_sync(str(tmp_path / "fast")) == [1]
    assert ckptstore.verify_sync(durable, 1).ok


def test_two_hosts_train_with_a_manager_on_their_own_fast_tiers(tmp_path: Path) -> None:
    durable = str(tmp_path / "durable")
    outputs = run_job(tmp_path, "tiered-manager", 2, durable)
    # The restart-style restore reads each host's own copy: the manager staged the replicas
    # a host holds but does not write (HostShards.extra), and the save wrote them there.
    assert outputs == ["manager ok saved [1, 2, 4, 6], read this host's fast copy\n"] * 2
    assert ckptstore.list_steps_sync(durable) == [4, 6]  # the keep policy, on the durable tier
    for i in (0, 1):  # keep_fast=1: each host keeps its part of the latest step only
        assert sorted(p.name for p in (tmp_path / f"fast{i}").iterdir()) == ["6"]


def start_job(root: Path, mode: str, logs: Path, num: int = 2) -> list[subprocess.Popen[str]]:
    """Start ``num`` workers; each one's stderr goes to ``logs/<mode>-<i>.err``."""
    coordinator = f"127.0.0.1:{free_port()}"
    logs.mkdir(exist_ok=True)
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(num), str(i), str(root), mode],
            stdout=subprocess.PIPE,
            stderr=(logs / f"{mode}-{i}.err").open("w"),
            text=True,
            cwd=WORKER.parents[1],
        )
        for i in range(num)
    ]


def preempt(procs: list[subprocess.Popen[str]], which: list[int], logs: Path) -> list[str]:
    """Wait until every worker trains, SIGTERM ``which``, and return what each printed."""
    started = [p.stdout.readline() for p in procs if p.stdout is not None]
    assert all(line.startswith("training from") for line in started), started
    time.sleep(0.5)  # some steps on both
    for i in which:
        procs[i].send_signal(signal.SIGTERM)
    outputs = []
    for i, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=120)
        err = (logs / f"preempt-{i}.err").read_text()
        assert proc.returncode == 0, f"process {i} failed:\n{err[-3000:]}"
        outputs.append(started[i] + out)
    return outputs


@pytest.mark.slow
def test_sigterm_on_one_or_both_processes_saves_the_same_step_on_both(tmp_path: Path) -> None:
    root, logs = tmp_path / "ckpt", tmp_path / "logs"
    # SIGTERM reaches process 1 only; JAX's preemption sync point tells both which step.
    first = preempt(start_job(root, "preempt", logs), [1], logs)
    step = int(first[0].split()[-1])
    assert first == [f"training from 0\npreempted at {step}\n"] * 2
    assert ckptstore.list_steps_sync(str(root))[-1] == step
    # A restart resumes from that step (each process checks its shards), then both get it.
    second = preempt(start_job(root, "preempt", logs), [0, 1], logs)
    later = int(second[0].split()[-1])
    assert later > step
    assert second == [f"training from {step}\npreempted at {later}\n"] * 2
    assert ckptstore.list_steps_sync(str(root))[-1] == later
    restored = ckptstore.restore_sync(str(root))
    for name in SHAPES:
        np.testing.assert_array_equal(restored[name], expected(name) + later)
