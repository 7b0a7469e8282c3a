"""CheckpointManager: staging and donation, policies, retention, errors, preemption, restart."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore import policies as pol
from ckptstore.backends.base import Backend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.format import layout
from ckptstore.lifecycle.policies import SaveContext, StepRecord
from ckptstore.testing.faults import FaultyBackend, InjectedPermanentFault
from tests.lifecycle.helpers import _DeletedFirst


def make_state(seed: int = 0) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(
            rng.standard_normal((64, 32)).astype(np.float32), NamedSharding(mesh, P("x", "y"))
        ),
        "b": jnp.asarray(rng.standard_normal(32), dtype=jnp.bfloat16),  # one device
        "replicated": jax.device_put(np.arange(16.0), NamedSharding(mesh, P())),
        "host": rng.standard_normal(8),
        "count": 3,
    }


@jax.jit
def _step(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "w": state["w"] * 2 + 1, "b": state["b"] + 1}


train_step = jax.jit(_step.__wrapped__, donate_argnums=0)  # type: ignore[attr-defined]


def host_copy(state: dict[str, Any]) -> dict[str, Any]:
    return jax.tree.map(lambda x: np.array(x) if hasattr(x, "shape") else x, state)


def assert_same(restored: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(restored) == sorted(expected)
    for key, want in expected.items():
        got = restored[key]
        if isinstance(want, np.ndarray):
            assert np.asarray(got).dtype == want.dtype
            assert np.asarray(got).tobytes() == want.tobytes(), key
        else:
            assert got == want and type(got) is type(want)


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "run")


def options(**kw: Any) -> ckptstore.ManagerOptions:
    return ckptstore.ManagerOptions(handle_sigterm=False, **kw)


# ---- staging ----


STAGING = ["host", "view", "device"]


@pytest.mark.parametrize("staging", STAGING)
def test_donating_and_deleting_right_after_save_returns(root: str, staging: str) -> None:
    with ckptstore.CheckpointManager(root, options=options(staging=staging)) as mgr:
        for step in (1, 2, 3):
            state = make_state(step)
            expected = host_copy(state)
            handle = mgr.save(step, state)
            assert handle is not None
            host = state["host"]
            state = train_step(state)  # donates w, b, replicated
            host[:] = -1  # and the caller scribbles on its numpy leaf
            for leaf in jax.tree.leaves(state):
                if isinstance(leaf, jax.Array):
                    leaf.delete()
            stats = handle.wait()
            assert stats.step == step and stats.staged_bytes > 0
            assert stats.staging_mode == staging
            assert_same(mgr.restore(step), expected)
            assert ckptstore.verify_sync(root, step=step).ok


@pytest.mark.parametrize("staging", STAGING)
def test_deleting_the_saved_arrays_and_reusing_their_memory(root: str, staging: str) -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    make = jax.jit(
        lambda k: jax.random.normal(k, (1024, 512)), out_shardings=NamedSharding(mesh, P("x", "y"))
    )
    with ckptstore.CheckpointManager(root, options=options(staging=staging)) as mgr:
        for step in (1, 2):
            state = {f"l{i}": make(jax.random.key(10 * step + i)) for i in range(8)}  # 16 MiB
            expected = host_copy(state)
            handle = mgr.save(step, state)
            for leaf in state.values():
                leaf.delete()  # its memory may now be handed out again...
            junk = [make(jax.random.key(1000 + i)) for i in range(8)]  # ...and overwritten
            jax.block_until_ready(junk)
            handle.wait()
            restored = mgr.restore(step)
            for key, want in expected.items():
                assert restored[key].tobytes() == want.tobytes(), key


def test_staging_reuses_its_buffers(root: str) -> None:
    with ckptstore.CheckpointManager(root, options=options(staging="host")) as mgr:
        state = make_state()
        expected = []
        for step in range(1, 4):
            expected.append(host_copy(state))
            mgr.save(step, state)
            held = mgr._stager.held_bytes
            buffers = {k: id(v) for k, v in mgr._stager._buffers.items()}
            state = train_step(state)
            mgr.wait_until_finished()
        # One staged copy of what this process writes, the same buffers every time.
        assert buffers == {k: id(v) for k, v in mgr._stager._buffers.items()}
        assert held == mgr.stats[-1].staged_bytes
        for step in range(1, 4):
            assert_same(mgr.restore(step), expected[step - 1])


@pytest.mark.parametrize("staging", STAGING)
def test_staging_budget_is_enforced(root: str, staging: str) -> None:
    opts = options(max_staging_bytes=10, staging=staging)
    with ckptstore.CheckpointManager(root, options=opts) as mgr:
        with pytest.raises(ckptstore.CkptStoreError, match="max_staging_bytes"):
            mgr.save(1, make_state())
        assert mgr.all_steps() == []


# ---- policies ----


def ctx(step: int, **kw: Any) -> SaveContext:
    base = dict(now=100.0, last_step=None, last_time=None, in_flight=False, preempted=False)
    return SaveContext(step=step, **{**base, **kw})


def test_clock_policies_save_the_first_step_each_manager_is_given(tmp_path: Path) -> None:
    """`EveryNSeconds` and `Continuous` save a manager's first step: step 1 of a fresh run,
    and the first step after a restart (docs/manager.md, "Policies")."""
    state = {"w": np.zeros(4, np.float32)}
    for policy, start, steps in (
        (pol.EveryNSeconds(3600), 1, [1]),
        (pol.EveryNSeconds(3600), 11, [1, 11]),  # restarted: its first step
        (pol.Continuous(3600), 21, [1, 11, 21]),
    ):
        with ckptstore.CheckpointManager(tmp_path, save_policy=policy) as mgr:
            for step in range(start, start + 5):
                mgr.save(step, state)
            mgr.wait_until_finished()
            assert mgr.all_steps() == steps


def test_save_policies() -> None:
    assert [s for s in range(10) if pol.EveryNSteps(3).should_save(ctx(s))] == [0, 3, 6, 9]
    every = pol.EveryNSeconds(10)
    assert every.should_save(ctx(1)) and not every.deterministic
    assert not every.should_save(ctx(2, last_time=95.0, last_step=1))
    assert every.should_save(ctx(3, last_time=90.0, last_step=1))
    assert [s for s in range(10) if pol.AtSteps([2, 7]).should_save(ctx(s))] == [2, 7]
    assert pol.InitialStep().should_save(ctx(0)) and not pol.InitialStep().should_save(
        ctx(5, last_step=0)
    )
    cont = pol.Continuous(min_interval=5)
    assert cont.should_save(ctx(1)) and not cont.should_save(ctx(2, in_flight=True))
    assert not cont.should_save(ctx(3, last_time=97.0)) and cont.should_save(ctx(3, last_time=90.0))
    assert pol.OnPreemption().should_save(ctx(7, preempted=True))
    assert not pol.OnPreemption().should_save(ctx(7))
    anyof = pol.AnyOf(pol.EveryNSteps(100), pol.OnPreemption())
    assert anyof.deterministic and not anyof.should_save(ctx(7))
    assert anyof.should_save(ctx(7, preempted=True)) and anyof.should_save(ctx(200))
    assert not pol.AnyOf(pol.EveryNSteps(2), pol.EveryNSeconds(1)).deterministic
    with pytest.raises(ckptstore.ConfigError):
        pol.EveryNSteps(0)
    with pytest.raises(ckptstore.ConfigError):
        pol.AnyOf()


def test_keep_policies() -> None:
    now = 1000.0
    records = [
        StepRecord(s, now - (10 - s) * 60, {"acc": a})
        for s, a in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.8), (5, 0.6), (6, float("nan"))]
    ]
    records.append(StepRecord(8, now, {}))
    assert pol.KeepLatest(2).keep(records, now) == {6, 8}
    assert pol.KeepEveryNSteps(2).keep(records, now) == {2, 4, 6, 8}
    # NaN and missing are never best; a step without the metric (8) is kept unless asked
    # otherwise, as Orbax's keep_checkpoints_without_metrics=True keeps it.
    assert pol.KeepBest(2, "acc").keep(records, now) == {2, 4, 8}
    assert pol.KeepBest(2, "acc", keep_without_metric=False).keep(records, now) == {2, 4}
    assert pol.KeepBest(1, "acc", mode="min").keep(records, now) == {1, 8}
    assert pol.KeepBest(1, "acc", "min", keep_without_metric=False).keep(records, now) == {1}
    assert pol.KeepFor(5 * 60).keep(records, now) == {6, 8}
    assert pol.KeepAnyOf(pol.KeepLatest(1), pol.KeepBest(1, "acc")).keep(records, now) == {2, 8}
    assert pol.KeepAll().keep(records, now) == {1, 2, 3, 4, 5, 6, 8}
    with pytest.raises(ckptstore.ConfigError):
        pol.KeepBest(1, "acc", mode="up")  # type: ignore[arg-type]


def test_manager_follows_save_and_keep_policies(root: str) -> None:
    keep = pol.KeepAnyOf(pol.KeepLatest(2), pol.KeepBest(1, "acc"))
    save = pol.AnyOf(pol.EveryNSteps(3), pol.AtSteps([1]))
    with ckptstore.CheckpointManager(
        root, save_policy=save, keep_policy=keep, options=options()
    ) as mgr:
        state = make_state()
        saved = []
        for step in range(1, 16):
            acc = 1.0 if step == 6 else step / 100
            if mgr.save(step, state, metrics={"acc": acc}) is not None:
                saved.append(step)
            state = train_step(state)
        mgr.wait_until_finished()
        assert saved == [1, 3, 6, 9, 12, 15]
        assert mgr.all_steps() == [6, 12, 15] and mgr.latest_step() == 15
        assert mgr.metrics(6) == {"acc": 1.0}
        assert [s.step for s in mgr.stats] == saved


def test_the_latest_step_is_never_deleted(root: str) -> None:
    keep = pol.KeepBest(1, "loss", mode="min")
    with ckptstore.CheckpointManager(root, keep_policy=keep, options=options()) as mgr:
        for step, loss in [(1, 0.1), (2, 0.5), (3, 0.9)]:
            mgr.save(step, {"x": np.full(3, step)}, metrics={"loss": loss})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]  # the best, and the latest though it is worst


def test_keep_best_keeps_a_step_saved_without_its_metric(root: str) -> None:
    keep = pol.KeepBest(1, "loss", mode="min")
    with ckptstore.CheckpointManager(root, keep_policy=keep, options=options()) as mgr:
        mgr.save(1, {"x": np.full(3, 1)}, metrics={"loss": 0.1})
        mgr.save(2, {"x": np.full(3, 2)})  # a preemption's save: no evaluation
        for step, loss in [(3, 0.5), (4, 0.9)]:
            mgr.save(step, {"x": np.full(3, step)}, metrics={"loss": loss})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 4]  # the best, the one without, the latest


def test_keep_every_interval_keeps_one_step_per_interval() -> None:
    # Saves every 20 minutes for 3 hours, two of them close together: one per hour stays.
    times = {s: s * 1200.0 for s in range(10)} | {10: 9 * 1200.0 + 5}
    records = [StepRecord(s, t, {}) for s, t in times.items()]
    assert pol.KeepEveryInterval(3600).keep(records, 99_999.0) == {0, 3, 6, 9}
    assert pol.KeepEveryInterval(1).keep(records, 0.0) == set(times)
    keep = pol.KeepAnyOf(pol.KeepLatest(2), pol.KeepEveryInterval(3600))
    assert keep.keep(records, 0.0) == {0, 3, 6, 9, 10}
    table = {"keep_every_interval": "1h"}
    assert ckptstore.ManagerOptions.from_table(table).keep_policy == pol.KeepEveryInterval(3600)
    for bad in (0, -1, float("inf")):
        with pytest.raises(ckptstore.ConfigError, match="KeepEveryInterval"):
            pol.KeepEveryInterval(bad)


def test_keep_without_metric_from_a_profile_table() -> None:
    table = {"keep_best": {"n": 2, "metric": "acc", "keep_without_metric": False}}
    policy = ckptstore.ManagerOptions.from_table(table).keep_policy
    assert policy == pol.KeepBest(2, "acc", keep_without_metric=False)
    default = ckptstore.ManagerOptions.from_table({"keep_best": {"metric": "acc"}}).keep_policy
    assert default == pol.KeepBest(1, "acc")
    bad = {"keep_best": {"metric": "acc", "keep_without_metric": "no"}}
    with pytest.raises(ckptstore.ConfigError, match="keep_without_metric must be true or false"):
        ckptstore.ManagerOptions.from_table(bad)


def attempts(root: str, step: int) -> list[str]:
    return sorted(p.name for p in (Path(root) / str(step)).iterdir() if p.is_dir())


def test_a_committed_step_is_refused_at_save_before_staging(root: str) -> None:
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        handle = mgr.save(1, make_state(1))
        assert handle is not None
        handle.wait()
        ckptstore.save_sync(root, make_state(2), step=2)  # another writer committed step 2
        for step in (1, 2):
            state = make_state(step)
            state["w"].delete()  # staging would refuse a deleted leaf: this is refused first
            with pytest.raises(ckptstore.AlreadyExistsError, match=f"step {step} is already"):
                mgr.save(step, state, force=True)
        handle = mgr.save(3, make_state(3))
        with pytest.raises(ckptstore.AlreadyExistsError, match="step 3 is already committed"):
            mgr.save(3, make_state(3), force=True)  # saved again while the first is in flight
        assert handle.wait().step == 3
        assert [len(attempts(root, step)) for step in (1, 2, 3)] == [1, 1, 1]  # nothing new
        handle = mgr.save(4, make_state(4))  # the manager carries on
        assert handle is not None and handle.wait().step == 4
        assert mgr.all_steps() == [1, 2, 3, 4]


def test_a_step_committed_only_on_the_durable_tier_is_refused_at_save(tmp_path: Path) -> None:
    tiers = ckptstore.Tiered(str(tmp_path / "fast"), str(tmp_path / "durable"))
    ckptstore.save_sync(tiers.durable, {"x": np.ones(3)}, step=5)
    with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
        with pytest.raises(ckptstore.AlreadyExistsError, match="step 5 is already committed"):
            mgr.save(5, {"x": np.zeros(3)}, force=True)
        assert ckptstore.list_steps_sync(tiers.fast) == []


async def test_retention_never_touches_a_step_being_written(tmp_path: Path) -> None:
    from tests.checkpoint.helpers import STALLS, Stalled

    root = str(tmp_path / "run")
    backend = ckptstore.open_backend(root)
    op, suffix, after = STALLS["merged"]
    other = Stalled(backend, op, suffix, after=after)  # another writer, mid-save of step 50
    task = asyncio.create_task(ckptstore.save(other, {"x": np.arange(4)}, step=50))
    await asyncio.wait_for(other.reached.wait(), 60)

    def run_manager() -> list[int]:
        with ckptstore.CheckpointManager(
            root, keep_policy=pol.KeepLatest(1), options=options(gc_grace=0.0, gc_on_start=False)
        ) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {"x": np.full(2, step)})
            mgr.wait_until_finished()
            return mgr.all_steps()

    assert await asyncio.to_thread(run_manager) == [3]
    other.release.set()
    await task
    assert await ckptstore.list_steps(root) == [3, 50]
    np.testing.assert_array_equal((await ckptstore.restore(root, step=50))["x"], np.arange(4))


# ---- timings ----


def phases(out: str) -> dict[str, float]:
    (line,) = [line for line in out.splitlines() if line.strip().startswith("timings:")]
    return {
        k: float(v.removesuffix(" s"))
        for k, v in (part.strip().split(" ", 1) for part in line.split(":", 1)[1].split(","))
    }


def test_every_phase_of_a_save_is_recorded_and_shown_by_info(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptstore.cli import main

    root = str(tmp_path / "run")
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        stats = mgr.save(1, make_state()).wait()
    assert stats.durable >= stats.staging + stats.write + stats.merge + stats.commit
    assert stats.bytes_written == stats.bytes > 0 and stats.staged_bytes > 0
    assert main(["info", root]) == 0
    out = capsys.readouterr().out
    shown = phases(out)
    assert sorted(shown) == ["commit", "merge", "staging", "write"]
    assert shown["staging"] == pytest.approx(stats.staging, abs=1e-3)
    assert 0 < shown["commit"] < stats.durable
    assert re.search(r"process 0: wrote \S+ \S+ in \d+ shards", out), out

    # Tiers: the step's promotion to the durable tier too (once both tiers have it).
    profile = tmp_path / "tiers.toml"
    profile.write_text('[tiers]\nfast = "fast"\ndurable = "durable"\n')
    with ckptstore.CheckpointManager(str(profile), options=options()) as mgr:
        mgr.save(2, {"x": np.arange(3)})
        mgr.wait_until_finished()
    assert main(["info", str(profile)]) == 0
    shown = phases(capsys.readouterr().out)
    assert sorted(shown) == ["commit", "merge", "promotion", "staging", "write"]
    assert shown["promotion"] >= 0


# ---- several items ----


def test_items_are_saved_and_restored_together(root: str) -> None:
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        state = make_state()
        expected = host_copy(state)
        data = {"epoch": 2, "offset": np.int64(12345)}
        mgr.save(4, items={"state": state, "data": data}, metadata={"note": "hi"}).wait()
        both = mgr.restore(items={"state": None, "data": None})
        assert_same(both["state"], expected)
        assert both["data"] == data
        assert mgr.restore(item="data") == data
        with pytest.raises(ckptstore.CheckpointNotFoundError, match="no item 'other'"):
            mgr.restore(item="other")
        with pytest.raises(ckptstore.CkptStoreError, match="not both"):
            mgr.save(5, state, items={"data": data})
        with pytest.raises(ckptstore.InvalidKeyError):
            mgr.save(5, items={"../up": data})


# ---- failures ----


def failing(root: str) -> Backend:
    inner = ckptstore.open_backend(root)
    return FaultyBackend(
        inner, fail_on={1}, ops={"create"}, error="permanent", retry=RetryPolicy(max_attempts=1)
    )


def test_background_error_surfaces_on_wait_and_is_not_repeated(root: str) -> None:
    mgr = ckptstore.CheckpointManager(failing(root), options=options())
    handle = mgr.save(1, {"x": np.arange(3)})
    with pytest.raises(InjectedPermanentFault):
        handle.wait()
    mgr.save(2, {"x": np.arange(3)}).wait()  # seen once: not raised again
    mgr.close()
    assert ckptstore.list_steps_sync(root) == [2]


def test_background_error_surfaces_on_the_next_save(root: str) -> None:
    mgr = ckptstore.CheckpointManager(failing(root), options=options())
    handle = mgr.save(1, {"x": np.arange(3)})
    concurrent_done = time.monotonic() + 60
    while not handle.done() and time.monotonic() < concurrent_done:
        time.sleep(0.01)
    with pytest.raises(InjectedPermanentFault):
        mgr.save(2, {"x": np.arange(3)})
    mgr.save(3, {"x": np.arange(3)})
    mgr.close()
    assert ckptstore.list_steps_sync(root) == [3]


def test_close_raises_an_unseen_error(root: str) -> None:
    mgr = ckptstore.CheckpointManager(failing(root), options=options())
    mgr.save(1, {"x": np.arange(3)})
    with pytest.raises(InjectedPermanentFault):
        mgr.close()


def test_if_busy_skip(root: str) -> None:
    slow = FaultyBackend(ckptstore.open_backend(root), latency=0.2)
    with ckptstore.CheckpointManager(slow, options=options(if_busy="skip")) as mgr:
        first = mgr.save(1, {"x": np.arange(3)})
        assert first is not None and mgr.save(2, {"x": np.arange(3)}) is None
        first.wait()
        assert mgr.save(3, {"x": np.arange(3)}) is not None
    assert ckptstore.list_steps_sync(root) == [1, 3]


# ---- preemption and restart ----


def test_sigterm_saves_the_step_and_tells_the_loop(root: str) -> None:
    policy = pol.AnyOf(pol.EveryNSteps(1000), pol.OnPreemption())
    previous = signal.getsignal(signal.SIGTERM)
    with ckptstore.CheckpointManager(root, save_policy=policy) as mgr:
        state = make_state()
        for step in range(1, 100):
            if step == 37:
                os.kill(os.getpid(), signal.SIGTERM)
            expected = host_copy(state)
            if mgr.save(step, state) is not None:
                assert mgr.preempted
                break
            state = train_step(state)
        assert step == 37
    assert signal.getsignal(signal.SIGTERM) == previous  # the manager's handler is gone
    assert ckptstore.list_steps_sync(root) == [37]
    assert_same(ckptstore.restore_sync(root), expected)


def test_preempted_turns_true_only_at_the_save_call_that_saves(root: str) -> None:
    # A SIGTERM landing between a step's save call and the loop's check of `preempted`
    # must not stop the loop on a step that was not saved: the next call sees it.
    policy = pol.AnyOf(pol.EveryNSteps(1000), pol.OnPreemption())
    with ckptstore.CheckpointManager(root, save_policy=policy) as mgr:
        assert mgr.save(1, {"x": np.arange(3)}) is None
        os.kill(os.getpid(), signal.SIGTERM)  # after step 1's call
        assert not mgr.preempted  # step 1 was not saved: the loop goes on
        assert mgr.save(2, {"x": np.arange(3)}) is not None
        assert mgr.preempted
    assert ckptstore.list_steps_sync(root) == [2]


def test_a_preemption_save_is_never_skipped(root: str) -> None:
    slow = FaultyBackend(ckptstore.open_backend(root), latency=0.2)
    policy = pol.AnyOf(pol.EveryNSteps(1), pol.OnPreemption())
    opts = ckptstore.ManagerOptions(if_busy="skip")  # SIGTERM handled
    with ckptstore.CheckpointManager(slow, save_policy=policy, options=opts) as mgr:
        first = mgr.save(1, {"x": np.arange(3)})
        assert first is not None and mgr.save(2, {"x": np.arange(3)}) is None  # busy: skipped
        os.kill(os.getpid(), signal.SIGTERM)
        assert not first.done()  # still in flight, yet the preemption's step is saved
        assert mgr.save(3, {"x": np.arange(3)}) is not None and mgr.preempted
    assert ckptstore.list_steps_sync(root) == [1, 3]


def test_a_restarted_manager_cleans_up_and_resumes(root: str) -> None:
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": np.full(3, step)})
    backend = ckptstore.open_backend(root)
    dead = layout.AttemptDir(3, layout.new_attempt())  # what a killed job left
    asyncio.run(backend.write(dead.manifest, b"{}"))
    with ckptstore.CheckpointManager(root, options=options(gc_grace=3600)) as mgr:
        mgr.wait_until_finished()  # the start-up gc runs in the background
        assert os.path.exists(os.path.join(root, dead.manifest))  # too young to be sure
    with ckptstore.CheckpointManager(root, options=options(gc_grace=0)) as mgr:
        assert not mgr.is_saving_in_progress()  # start-up work is no save
        mgr.wait_until_finished()
        assert not os.path.exists(os.path.join(root, dead.manifest))
        assert mgr.latest_step() == 2
        np.testing.assert_array_equal(mgr.restore()["x"], np.full(3, 2))
        assert pol.InitialStep().should_save(ctx(0, last_step=mgr._last_step)) is False


def test_options_from_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "run.toml"
    profile.write_text(
        f'url = "{tmp_path / "run"}"\n[manager]\nsave_every_steps = 2\nkeep_latest = 1\n'
        'if_busy = "wait"\ngc_grace = "10m"\nhandle_sigterm = false\n'
    )
    with ckptstore.CheckpointManager(str(profile)) as mgr:
        assert mgr.options.gc_grace == 600
        for step in range(1, 6):
            mgr.save(step, {"x": np.full(2, step)})
    assert ckptstore.list_steps_sync(str(tmp_path / "run")) == [4]
    profile.write_text(f'url = "{tmp_path / "run"}"\n[manager]\nkeep_lastest = 1\n')
    with pytest.raises(ckptstore.ConfigError, match="unknown keys"):
        ckptstore.CheckpointManager(str(profile))


def test_none_means_the_profile_of_the_environment_with_its_manager_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "With CKPTSTORE_PROFILE set, pass None" (the plain functions accept it); the
    manager crashed with a TypeError before opening anything."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "run.toml").write_text(
        f'url = "{tmp_path / "run"}"\n[manager]\nsave_every_steps = 2\nkeep_latest = 1\n'
        "handle_sigterm = false\n"
    )
    monkeypatch.setenv("CKPTSTORE_PROFILES_DIR", str(profiles))
    monkeypatch.setenv("CKPTSTORE_PROFILE", "run")  # by name, as the plain functions take it
    with ckptstore.CheckpointManager(None) as mgr:
        assert mgr.save_policy == pol.EveryNSteps(2) and not mgr.options.handle_sigterm
        for step in range(1, 6):
            mgr.save(step, {"x": np.full(2, step)})
    assert ckptstore.list_steps_sync(None) == [4]
    assert ckptstore.list_steps_sync(str(tmp_path / "run")) == [4]
    monkeypatch.delenv("CKPTSTORE_PROFILE")
    with pytest.raises(ckptstore.InvalidURLError, match="CKPTSTORE_PROFILE"):
        ckptstore.CheckpointManager(None)


async def test_usable_from_async_code(root: str) -> None:
    async with ckptstore.CheckpointManager(root, options=options()) as mgr:
        handle = mgr.save(1, {"x": np.arange(5)})
        stats = await handle
        assert stats.step == 1
    assert await ckptstore.list_steps(root) == [1]


def test_a_bad_target_fails_before_any_thread_starts(tmp_path: Path) -> None:
    import threading

    before = threading.active_count()
    with pytest.raises(ckptstore.ConfigError, match="does not exist"):
        ckptstore.CheckpointManager(str(tmp_path / "typo.toml"))
    assert threading.active_count() == before


class _DropsOlder(pol.KeepPolicy):
    """KeepLatest(1), arming `_DeletedFirst` for each step it drops."""

    def __init__(self, backend: _DeletedFirst):
        self.backend = backend

    def keep(self, records: Any, now: float) -> set[int]:
        latest = max(r.step for r in records)
        self.backend.armed = {r.step for r in records if r.step != latest}
        return {latest}


def test_the_keep_policy_succeeds_when_another_process_deleted_the_step_first(
    tmp_path: Path,
) -> None:
    from ckptstore.backends.local import LocalBackend

    backend = _DeletedFirst(LocalBackend(tmp_path / "run"))
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    tree = {"w": np.arange(8, dtype=np.float32)}
    with ckptstore.CheckpointManager(
        backend, keep_policy=_DropsOlder(backend), options=opts
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, tree)
            mgr.wait_until_finished()  # raised CheckpointNotFoundError before
        assert mgr.all_steps() == [3]
    assert ckptstore.list_steps_sync(str(tmp_path / "run")) == [3]


NEVER_CLOSED = """
import asyncio, sys
import numpy as np
import ckptstore
from ckptstore.backends.local import LocalBackend

class SlowMarker(LocalBackend):  # the save is still in flight when the script returns
    async def _create(self, key, data):
        if "COMMITTED" in key:
            await asyncio.sleep(1.0)
        await super()._create(key, data)

opts = ckptstore.ManagerOptions(handle_sigterm=False)
mgr = ckptstore.CheckpointManager(SlowMarker(sys.argv[1]), options=opts)
mgr.save(7, {"w": np.arange(16, dtype=np.float32)})
print("in flight" if not mgr._inflight.done() else "done", flush=True)
"""


def test_a_script_that_never_closes_its_manager_still_commits_its_last_save(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", NEVER_CLOSED, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "in flight"  # else this test shows nothing
    assert "finishing the save of step 7 before exit" in proc.stderr
    assert ckptstore.list_steps_sync(str(root)) == [7]
    assert ckptstore.verify_sync(str(root), step=7).ok


def test_saving_a_step_older_than_the_last_one_says_so(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        for step in (1, 0):
            handle = mgr.save(step, {"w": np.arange(3.0)})
            assert handle is not None
            handle.wait()
        assert mgr.latest_step() == 1
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("saving step 0 after step 1" in m for m in warned), warned
