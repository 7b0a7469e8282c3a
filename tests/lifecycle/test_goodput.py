"""`policies.Goodput`: the save interval that loses the least work, from the save cost it
measures in the loop and a declared MTBF. A simulated loop (a known step time, a save's
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
    ``clock`` ([now, last save start, write end]) carries the loop on from an earlier call."""
    now, last, write_end = clock if clock else [0.0, -1.0, -1.0]
    starts = []
    first = int(now / step) if clock else 0
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
        clock[:] = [now, last, write_end]
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
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="Goodput"):
        P.Goodput(**kwargs)  # type: ignore[arg-type]


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
