"""`policies.Goodput`: the save interval that loses the least work, from the save cost it
measures in the loop and a declared or observed MTBF. A simulated loop (a known step time, a save's
pause and the slower steps while it is written) against the optimum a sweep of fixed
intervals finds, with simulated failures; and a real manager feeding it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore import policies as P
from ckptstore.errors import ConfigError

MTBF = 3600.0


def simulate(
    policy: P.SavePolicy,
    steps: int,
    *,
    pause: float,
    write: float,
    slow: float,
    step: float = 1.0,
    clock: list[float] | None = None,
) -> list[float]:
    """Run ``steps`` steps of a loop that asks ``policy`` at every step, as the manager
    does; a save pauses the loop ``pause`` seconds, then is written for ``write`` seconds,
    during which each step takes ``1 + slow`` times as long. Returns the save start times.
    ``clock`` ([now, last save start, write end], and the next step's number if given)
    carries the loop on from an earlier call."""
    now, last, write_end = clock[:3] if clock else [0.0, -1.0, -1.0]
    starts = []
    first = (int(clock[3]) if len(clock) > 3 else int(now / step)) if clock else 0
    for k in range(first, first + steps):
        busy = now < write_end
        ctx = P.SaveContext(k, now, None, None if last < 0 else last, busy, False)
        if policy.should_save(ctx) and not busy:
            last = now
            starts.append(now)
            now += pause
            write_end = now + write
        now += step * (1 + slow) if now < write_end else step
    if clock is not None:
        clock[:] = [now, last, write_end, first + steps]
    return starts


def best_interval(pause: float, write: float, slow: float, seed: int = 7) -> float:
    """The interval between save starts that keeps the most work, found by a sweep over
    fixed intervals of the loop above with failures: runs between failures last
    Exp(MTBF); a failure loses everything since the start of the last save that had
    become durable (pause + write after it started); a save costs the loop its pause plus
    the work its slowed steps did not do."""
    cost = pause + write * slow / (1 + slow)
    runs = np.random.default_rng(seed).exponential(MTBF, 100_000)
    grid = np.arange(20.0, 800.0, 2.0)
    kept = []
    for period in grid:
        durable = np.floor((runs - pause - write) / period).clip(min=0)
        work = np.where(durable >= 1, durable * period - (durable - 1) * cost, 0.0)
        kept.append(work.sum() / runs.sum())
    return float(grid[int(np.argmax(kept))])


def test_the_interval_chosen_is_within_ten_percent_of_the_sweeps_optimum() -> None:
    policy = P.Goodput(mtbf=MTBF, min_interval=30)
    starts = simulate(policy, 20_000, pause=2.0, write=30.0, slow=0.5)
    best = best_interval(pause=2.0, write=30.0, slow=0.5)
    metrics = policy.metrics()
    assert metrics["save_cost_s"] == pytest.approx(2 + 30 * 0.5 / 1.5, rel=0.1)
    assert metrics["step_s"] == pytest.approx(1.0)
    assert policy.interval() == pytest.approx(best, rel=0.1), (metrics, best)
    gaps = np.diff(starts[-10:])  # the loop saved at that interval (to the next step)
    assert gaps.min() >= policy.interval() and gaps.max() <= policy.interval() + 2
    lost = metrics["expected_lost_fraction"]
    assert lost is not None and 0.05 < lost < 0.15  # ~ c/interval + interval/(2 MTBF)


def test_the_interval_follows_the_save_cost_when_it_changes() -> None:
    """Full saves, then incremental ones (a short pause, a short write): the interval
    shortens to the new optimum within a few saves, and back again."""
    policy = P.Goodput(mtbf=MTBF, min_interval=10)
    clock: list[float] = []
    simulate(policy, 10_000, pause=2.0, write=30.0, slow=0.5, clock=clock)
    full = policy.interval()
    simulate(policy, 3_000, pause=0.2, write=3.0, slow=0.5, clock=clock)
    incremental = policy.interval()
    assert incremental == pytest.approx(best_interval(0.2, 3.0, 0.5), rel=0.1)
    assert incremental < full / 2
    simulate(policy, 10_000, pause=2.0, write=30.0, slow=0.5, clock=clock)
    assert policy.interval() == pytest.approx(full, rel=0.05)


def test_never_more_often_than_the_floor_nor_before_it() -> None:
    policy = P.Goodput(mtbf=60.0, min_interval=100, max_interval=400)
    starts = simulate(policy, 2_000, pause=5.0, write=10.0, slow=0.0)
    assert starts[0] >= 100  # the first save waits the floor after the first step
    assert min(np.diff(starts)) >= 100  # the optimum (~25 s) is below the floor
    assert policy.interval() == 100
    rare = P.Goodput(mtbf=1e9, min_interval=10, max_interval=400)
    simulate(rare, 3_000, pause=5.0, write=10.0, slow=0.0)
    assert rare.interval() == 400


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mtbf": 0},
        {"mtbf": -5},
        {"mtbf": 100, "min_interval": 0},
        {"mtbf": 100, "min_interval": 50, "max_interval": 10},
        {"mtbf": 100, "decay": 1.0},
        {"mtbf": True},
        {"mtbf": float("inf")},
        {"mtbf": float("nan")},
        {"mtbf": 100, "min_interval": float("inf")},
        {"mtbf": 100, "max_interval": float("inf")},
        {"prior_mtbf": float("inf")},
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="Goodput"):
        P.Goodput(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda: P.EveryNSeconds(float("inf")),
        lambda: P.KeepFor(float("inf")),
        lambda: P.EveryNSeconds(float("nan")),
    ],
)
def test_infinite_intervals_are_refused_by_every_policy(make: object) -> None:
    with pytest.raises(ConfigError, match="finite"):
        make()  # type: ignore[operator]


def test_a_manager_feeds_it_at_every_save_call(tmp_path: Path) -> None:
    """Through a real manager (with OnPreemption beside it in AnyOf, which asks every
    policy): the policy measures the step time and the saves' cost and saves by itself."""
    policy = P.Goodput(mtbf=3600, min_interval=0.05, max_interval=0.1)
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    with ckptstore.CheckpointManager(
        tmp_path / "run", save_policy=P.AnyOf(P.OnPreemption(), policy), options=options
    ) as mgr:
        step = 0
        while policy.saves_measured < 2 and step < 5_000:  # bounded: never a hang
            mgr.save(step, state)
            time.sleep(0.005)  # the training step
            step += 1
        mgr.wait_until_finished()
        metrics = policy.metrics()
        assert policy.saves_measured >= 2, metrics
        assert metrics["step_s"] is not None and metrics["step_s"] >= 0.005
        assert metrics["save_cost_s"] is not None and metrics["save_cost_s"] >= 0
        assert len(mgr.all_steps()) >= 1


class Remembered(P.SavePolicy):
    """``inner``, with each record a save would keep and when that save becomes durable
    (the manager keeps the record in the step it saves)."""

    deterministic = False

    def __init__(self, inner: P.Goodput, pause: float, write: float) -> None:
        self.inner, self.lag = inner, pause + write
        self.kept: list[tuple[float, dict[str, object]]] = []  # (durable at, record)

    def should_save(self, ctx: P.SaveContext) -> bool:
        yes = self.inner.should_save(ctx)
        if yes and not ctx.in_flight:
            self.kept.append((ctx.now + self.lag, self.inner.record()))
        return yes


def test_an_observed_failure_rate_gives_the_interval_a_declared_one_would() -> None:
    """No MTBF declared: a job that fails after Exp(MTBF) seconds of each run restarts
    its policy from the record of its last durable save; after the restarts the policy
    counted, its MTBF estimate and its interval are the sweep's optimum within 10%."""
    rng = np.random.default_rng(3)
    record: dict[str, object] | None = None
    ran = failures = 0.0
    for _ in range(150):
        policy = P.Goodput(min_interval=30)
        policy.resume(record)
        loop = Remembered(policy, pause=2.0, write=30.0)
        clock, fails_at = [0.0, -1.0, -1.0, 0], rng.exponential(MTBF)
        while clock[0] < fails_at:
            simulate(loop, 1, pause=2.0, write=30.0, slow=0.5, clock=clock)
        ran, failures = ran + clock[0], failures + 1
        durable = [kept for at, kept in loop.kept if at <= clock[0]]
        record = durable[-1] if durable else record
    policy = P.Goodput(min_interval=30)
    policy.resume(record)
    metrics = policy.metrics()
    assert metrics["mtbf_from"] == "observed" and 140 <= policy.restarts <= 150, metrics
    assert policy.mtbf == pytest.approx(ran / failures, rel=0.05), metrics  # what happened
    best = best_interval(pause=2.0, write=30.0, slow=0.5)
    assert policy.interval() == pytest.approx(best, rel=0.1), (metrics, best)


def test_before_any_restart_the_prior_stands_and_a_declared_mtbf_is_kept() -> None:
    fresh = P.Goodput(prior_mtbf=7200, min_interval=1)
    simulate(fresh, 100, pause=1.0, write=5.0, slow=0.0)
    assert fresh.mtbf == 7200 and fresh.restarts == 0
    assert fresh.metrics()["mtbf_from"] == "observed"
    long_run = P.Goodput(prior_mtbf=10, min_interval=1)
    simulate(long_run, 100, pause=1.0, write=5.0, slow=0.0)
    assert long_run.mtbf == pytest.approx(long_run.run_seconds()) and long_run.mtbf > 99
    declared = P.Goodput(mtbf=MTBF, min_interval=1)
    declared.resume({"run_s": 50.0, "restarts": 9, "interval_s": 10.0, "save_cost_s": 3.0})
    assert declared.mtbf == MTBF and declared.restarts == 10 and declared.save_cost == 3.0


@pytest.mark.parametrize(
    "record",
    [
        None,
        "a string",
        {"restarts": 2},
        {"run_s": -1.0, "restarts": 2},
        {"run_s": float("nan"), "restarts": 2},
        {"run_s": 10.0, "restarts": True},
        {"run_s": 10.0, "restarts": "2"},
    ],
)
def test_a_record_of_another_shape_is_ignored(record: object) -> None:
    policy = P.Goodput(prior_mtbf=500, min_interval=1)
    policy.resume(record)  # type: ignore[arg-type]
    assert policy.restarts == 0 and policy.mtbf == 500 and policy.save_cost is None


def test_a_restarted_manager_resumes_the_policy_from_the_latest_step(tmp_path: Path) -> None:
    """A real manager keeps the policy's record with every save; the next manager on the
    root (the job restarted) resumes from the latest step's: one restart, the run time
    before it, and the save cost measured then. A policy inside AnyOf too."""
    state = {"w": np.arange(1 << 12, dtype=np.float32)}
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    first = P.Goodput(prior_mtbf=600, min_interval=0.02, max_interval=0.05)
    policy = P.AnyOf(P.OnPreemption(), first)
    keep = P.KeepLatest(2)  # each keep-policy turn lists a few steps, however long it runs
    with ckptstore.CheckpointManager(
        tmp_path, save_policy=policy, keep_policy=keep, options=options
    ) as mgr:
        step = 0
        while first.saves_measured < 2 and step < 5_000:  # bounded: never a hang
            mgr.save(step, state)
            time.sleep(0.005)
            step += 1
        mgr.save(step, state, force=True)  # its record has the costs measured by now
        mgr.wait_until_finished()
        (_, kept) = ckptstore.read_manifest_sync(tmp_path).metadata["save_policy"]["any_of"]
    assert kept["restarts"] == 0 and kept["run_s"] > 0, kept
    second = P.Goodput(prior_mtbf=600, min_interval=0.02)
    with ckptstore.CheckpointManager(
        tmp_path, save_policy=P.AnyOf(P.OnPreemption(), second), options=options
    ):
        pass
    assert second.restarts == 1
    assert second.run_seconds() == pytest.approx(kept["run_s"] + kept["interval_s"] / 2)
    assert second.save_cost == kept["save_cost_s"] is not None
    assert second.mtbf == pytest.approx(second.run_seconds())  # one failure in that run


def test_the_docs_example_runs_as_written(tmp_path: Path) -> None:
    import contextlib
    import io
    import re

    text = (Path(__file__).parents[2] / "docs" / "manager.md").read_text()
    (section,) = re.findall(r"### A save interval chosen for goodput\n(.*?)\n## ", text, re.S)
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    code = code.replace('"/tmp/goodput-run"', repr(str(tmp_path / "goodput-run")))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/manager.md", "exec"), {"__name__": "example"})
    (said,) = re.findall(r"# (\[.*\])", code)
    assert printed.getvalue().strip() == said
