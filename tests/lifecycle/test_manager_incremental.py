"""`ManagerOptions(incremental=True)`: each save references what the last committed step
holds; the keep policy deletes old steps and their referenced bytes stay; a base that
goes is a full save; a run SIGKILLed mid-save resumes (`incremental_worker.py`). On tiers:
tests/tiers/test_manager_incremental_tiers.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ckptstore
from ckptstore import policies as pol
from ckptstore.format import layout
from ckptstore.protocol import load_committed
from ckptstore.runtime.blocking import run
from tests.lifecycle.helpers import CHANGED, FROZEN, OVERHEAD, assert_bit_exact, host, options
from tests.lifecycle.incremental_worker import advance, initial, like, state_at

REPO = Path(__file__).resolve().parents[2]


def disk_usage(path: Path) -> int:
    """Bytes of every file below ``path`` (0 if it does not exist)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("staging", ["host", "view"])
def test_a_lora_loop_writes_the_changed_bytes_and_keeps_what_it_references(
    tmp_path: Path, staging: str
) -> None:
    root = tmp_path / "run"
    expected: dict[int, Any] = {}
    keep = pol.KeepLatest(2)
    with ckptstore.CheckpointManager(
        str(root), keep_policy=keep, options=options(staging=staging)
    ) as mgr:
        state = initial()
        for step in range(1, 7):
            state = advance(state, jnp.int32(step))
            expected[step] = host(state)
            handle = mgr.save(step, state)
            assert handle is not None
            handle.wait()
        mgr.wait_until_finished()
        stats = list(mgr.stats)

    first, later = stats[0], stats[1:]
    assert first.base is None and first.bytes_referenced == 0
    assert first.bytes_written == first.bytes == FROZEN + CHANGED
    for s in later:  # exactly the changed bytes: the frozen base is referenced
        assert (s.base, s.bytes_written, s.bytes_referenced) == (s.step - 1, CHANGED, FROZEN)

    assert ckptstore.list_steps_sync(str(root)) == [5, 6]
    step1 = run(load_committed(ckptstore.open_backend(str(root)), 5)).references
    assert [r.step for r in step1] == [1]  # the original holder, never a chain
    for step in (5, 6):
        assert_bit_exact(ckptstore.restore_sync(str(root), step, like()), expected[step])
        assert ckptstore.verify_sync(str(root), step).ok
    # Step 1 left every listing, its bytes stayed: the kept steps read the base there.
    assert not (root / layout.commit_key(1)).exists()
    assert disk_usage(root / "1") >= FROZEN
    # The whole run on disk: the base once, step 1's own adapters, the two kept steps'.
    total = disk_usage(root)
    assert FROZEN + 3 * CHANGED <= total <= FROZEN + 3 * CHANGED + 3 * OVERHEAD, total

    ckptstore.gc_sync(str(root), older_than=0)  # referenced: kept, whatever the grace
    assert disk_usage(root / "1") >= FROZEN
    assert_bit_exact(ckptstore.restore_sync(str(root), 6, like()), expected[6])
    for step in (5, 6):
        ckptstore.delete_step_sync(str(root), step)
    ckptstore.gc_sync(str(root), older_than=0)  # nothing references step 1 now: freed
    assert disk_usage(root) < OVERHEAD


def test_digests_are_of_the_staged_copy(tmp_path: Path) -> None:
    """A numpy leaf changed in place once `save` returned is saved as it was at the call,
    and the decision to reference it is made on that copy too."""
    root = str(tmp_path / "run")
    frozen = np.arange(1 << 20, dtype=np.float32)
    at_call = frozen.copy()
    with ckptstore.CheckpointManager(root, options=options(staging="host")) as mgr:
        mgr.save(1, {"w": frozen, "k": np.int64(1)})
        handle = mgr.save(2, {"w": frozen, "k": np.int64(2)})
        assert handle is not None
        frozen[:] = -1  # while step 2 is in flight
        second = handle.wait()
        third = mgr.save(3, {"w": frozen, "k": np.int64(3)})
        assert third is not None
        third_stats = third.wait()
    assert second.bytes_referenced == frozen.nbytes and second.bytes_written == 8
    assert third_stats.bytes_referenced == 0 and third_stats.bytes_written == frozen.nbytes + 8
    np.testing.assert_array_equal(ckptstore.restore_sync(root, 2)["w"], at_call)
    np.testing.assert_array_equal(ckptstore.restore_sync(root, 3)["w"], frozen)


def tree(k: int) -> dict[str, Any]:
    return {"w": np.arange(1 << 18, dtype=np.float32), "k": np.full(4, k, np.int32)}


def test_a_manager_that_is_not_incremental_records_no_digests(tmp_path: Path) -> None:
    """Digests (a hash of every byte) are recorded only where a save will compare them: a
    plain manager's steps have none, so an incremental save on one writes every leaf,
    correctly; an incremental manager's first save, not incremental itself, has them."""
    plain, incremental = str(tmp_path / "plain"), str(tmp_path / "incremental")
    big = {"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024), "k": np.arange(3)}
    not_incremental = ckptstore.ManagerOptions(handle_sigterm=False)
    for root, opts in ((plain, not_incremental), (incremental, options())):
        with ckptstore.CheckpointManager(root, options=opts) as mgr:
            handle = mgr.save(1, big)
            assert handle is not None
            handle.wait()
    backend = ckptstore.open_backend(plain)
    assert all(not item.digests for item in run(load_committed(backend, 1)).items.values())
    got = run(load_committed(ckptstore.open_backend(incremental), 1)).items
    assert set(got[layout.DEFAULT_ITEM].digests) == {"w", "k"}

    on_plain = ckptstore.save_sync(plain, big, step=2, base=1)
    on_incremental = ckptstore.save_sync(incremental, big, step=2, base=1)
    assert on_plain.bytes_referenced == 0 and on_plain.bytes_written == on_plain.bytes
    assert on_incremental.bytes_referenced == on_incremental.bytes
    for root in (plain, incremental):
        assert_bit_exact(ckptstore.restore_sync(root, 2), big)


def test_a_base_deleted_by_someone_else_means_a_full_save(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        assert mgr.save(1, tree(1)) is not None
        mgr.wait_until_finished()
        ckptstore.delete_step_sync(root, 1)  # another job, or `ckptstore rm`
        handle = mgr.save(2, tree(2))
        assert handle is not None
        stats = handle.wait()
        assert stats.base is None and stats.bytes_written == stats.bytes
        handle = mgr.save(3, tree(3))  # and the next one references step 2
        assert handle is not None
        assert handle.wait().base == 2
    assert ckptstore.list_steps_sync(root) == [2, 3]
    assert_bit_exact(ckptstore.restore_sync(root, 3), tree(3))


def test_a_base_deleted_while_the_save_commits_falls_back_to_a_full_save_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The base goes after the save read it and before its manifest: the commit's
    re-check refuses the incremental step (`BaseStepGoneError`), and the manager saves it
    again in full from the same staged copy; the handle succeeds."""
    root = str(tmp_path / "run")
    backend = ckptstore.open_backend(root)
    write = backend.write
    deleted: list[int] = []

    async def deleting_first(key: str, data: bytes) -> None:
        if key.startswith("2/") and key.endswith(layout.MANIFEST) and not deleted:
            deleted.append(1)
            await ckptstore.delete_step(backend, 1)
        await write(key, data)

    with ckptstore.CheckpointManager(backend, options=options()) as mgr:
        assert mgr.save(1, tree(1)) is not None
        mgr.wait_until_finished()
        monkeypatch.setattr(backend, "write", deleting_first)
        handle = mgr.save(2, tree(2))
        assert handle is not None
        with caplog.at_level("WARNING", logger="ckptstore"):
            stats = handle.wait()
    assert deleted == [1]
    assert stats.base is None and stats.bytes_written == stats.bytes
    assert "step 2 saved in full" in caplog.text
    assert ckptstore.list_steps_sync(root) == [2]
    assert not run(load_committed(backend, 2)).references
    assert_bit_exact(ckptstore.restore_sync(root, 2), tree(2))
    assert ckptstore.verify_sync(root, 2).ok
    run(backend.close())


def test_incremental_from_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "run.toml"
    profile.write_text(
        f'url = "{tmp_path / "run"}"\n[manager]\nincremental = true\nhandle_sigterm = false\n'
    )
    with ckptstore.CheckpointManager(str(profile)) as mgr:
        assert mgr.options.incremental is True
        for step in (1, 2):
            handle = mgr.save(step, tree(step))
            assert handle is not None
            handle.wait()
        assert mgr.stats[-1].base == 1
    profile.write_text(f'url = "{tmp_path / "run"}"\n[manager]\nincremental = "yes"\n')
    with pytest.raises(ckptstore.ConfigError, match="incremental"):
        ckptstore.CheckpointManager(str(profile))
    with pytest.raises(ckptstore.ConfigError, match="incremental"):
        ckptstore.ManagerOptions(incremental="yes")  # type: ignore[arg-type]


STEPS = 8


def worker(root: Path, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    module = "tests.lifecycle.incremental_worker"
    proc = subprocess.run(
        [sys.executable, "-m", module, str(root), str(STEPS), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode, lines


def test_killed_mid_save_and_resumed(tmp_path: Path) -> None:
    """SIGKILL right after ``save(5)`` returned (step 5 in flight); the resumed run starts
    from the latest committed step, its first save is incremental on it, and every kept
    step restores bit-exact, as does the end state of a run never killed."""
    root = tmp_path / "run"
    code, first = worker(root, "--die-at", "5")
    assert code == -signal.SIGKILL
    assert [line["step"] for line in first] == [1, 2, 3, 4]
    assert all(line["written"] == CHANGED for line in first[1:])
    code, second = worker(root)
    assert code == 0
    saves = [line for line in second if "step" in line]
    resumed_from = saves[0]["step"] - 1
    assert resumed_from in (4, 5)  # step 5 committed before the kill, or it did not
    for line in saves:  # every save after the restart references the frozen base
        assert line["base"] == line["step"] - 1
        assert (line["written"], line["referenced"]) == (CHANGED, FROZEN)
    assert ckptstore.list_steps_sync(str(root)) == [STEPS - 1, STEPS]
    for step in (STEPS - 1, STEPS):
        got = ckptstore.restore_sync(str(root), step, like())
        assert_bit_exact(got, host(state_at(step)))
        assert ckptstore.verify_sync(str(root), step).ok
    code, whole = worker(tmp_path / "whole")
    assert code == 0 and whole[-1]["digest"] == second[-1]["digest"]


@pytest.fixture
def accelerator_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager takes these CPU arrays for an accelerator's, which never share memory
    with a numpy buffer: only there is the very object saved before trusted unchanged
    (on CPU devices it is digested, `test_aliasing.py`)."""
    from ckptstore.lifecycle import writing

    monkeypatch.setattr(writing, "may_share_host_memory", lambda value: False)


@pytest.mark.usefixtures("accelerator_arrays")
def test_the_very_arrays_of_the_last_save_are_not_digested_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `jax.Array` on an accelerator never changes: one the manager saved last time (the
    base) is referenced without reading it again; a new array under the same name is
    digested, and written if it differs."""
    from ckptstore.checkpoint import incremental

    digested: list[tuple[int, ...]] = []
    real = incremental.piece_table

    async def counting(pieces: Any, shape: Any, *rest: Any) -> Any:
        digested.append(tuple(shape))
        return await real(pieces, shape, *rest)

    monkeypatch.setattr(incremental, "piece_table", counting)
    frozen = jax.device_put(np.arange(64 * 48, dtype=np.float32).reshape(64, 48))
    with ckptstore.CheckpointManager(tmp_path, options=options()) as mgr:
        mgr.save(1, {"frozen": frozen, "x": jnp.ones(5)}).wait()
        digested.clear()
        second = mgr.save(2, {"frozen": frozen, "x": jnp.ones(5) * 2}).wait()
        assert (64, 48) not in digested and (5,) in digested
        assert second.bytes_referenced == frozen.nbytes
        same_values = frozen + 0  # another object, the same content: digested, referenced
        third = mgr.save(3, {"frozen": same_values, "x": jnp.ones(5) * 3}).wait()
        assert (64, 48) in digested and third.bytes_referenced == frozen.nbytes
        digested.clear()
        changed = frozen + 1
        fourth = mgr.save(4, {"frozen": changed, "x": jnp.ones(5) * 4}).wait()
        assert (64, 48) in digested and fourth.bytes_referenced == 0
        for step, want in ((2, frozen), (3, frozen), (4, changed)):
            got = mgr.restore(step)
            np.testing.assert_array_equal(got["frozen"], np.asarray(want))


@pytest.mark.usefixtures("accelerator_arrays")
def test_a_base_another_writer_saved_again_is_never_referenced(tmp_path: Path) -> None:
    """The manager saves step 1 from arrays X; another writer deletes step 1 and saves it
    again with values Y; the manager saves step 2 from the very same X objects. Step 2
    holds X (saved in full once, as when a base goes), never Y's bytes by reference."""
    root = str(tmp_path / "run")
    x = {"frozen": jnp.arange(4096, dtype=jnp.float32), "w": jnp.ones(64, jnp.float32)}
    y = {"frozen": np.full(4096, 7.0, np.float32), "w": np.full(64, 7.0, np.float32)}
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        mgr.save(1, x).wait()  # type: ignore[union-attr]
        ckptstore.delete_step_sync(root, 1)  # another writer (`ckptstore rm`, then a save)
        ckptstore.save_sync(root, y, step=1)
        mgr.save(2, x).wait()  # type: ignore[union-attr]
        stats = list(mgr.stats)
    assert stats[1].bytes_referenced == 0 and stats[1].base is None
    assert_bit_exact(ckptstore.restore_sync(root, step=2), host(x))
    assert_bit_exact(ckptstore.restore_sync(root, step=1), y)
    assert ckptstore.verify_sync(root, step=2).ok
