"""Save and keep policies: explicit objects that compose.

Save policies answer "save at this step?" from a `SaveContext`; keep policies answer
"which committed steps stay?" from the list of `StepRecord`s. Combine them with
`AnyOf` and `KeepAnyOf`. The manager never deletes the latest committed step, nor a
step that is still being written, whatever a keep policy says.

    from ckptstore import policies as P
    save_policy = P.AnyOf(P.EveryNSteps(1000), P.EveryNSeconds(1800), P.OnPreemption())
    save_policy = P.AnyOf(P.Goodput(mtbf=6 * 3600), P.OnPreemption())  # the interval chosen
    keep_policy = P.KeepAnyOf(P.KeepLatest(3), P.KeepBest(1, "val_acc", mode="max"))
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptstore.errors import ConfigError

# ---- save policies ----


@dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at."""

    step: int
    now: float  # seconds (time.monotonic)
    last_step: int | None  # the last step this manager saved (or found committed), if any
    last_time: float | None  # when this manager last started a save (None: never)
    in_flight: bool  # a save of this manager is still running
    preempted: bool  # the job is being preempted (agreed by every process)


class SavePolicy(ABC):
    """Decides whether a step is saved."""

    #: Whether every process reaches the same answer from the same step alone (no clocks);
    #: otherwise process 0 decides for everyone in a multi-process job.
    deterministic: bool = True

    #: Whether the policy keeps a record with each save (`record`) and resumes from it
    #: after a restart (`resume`): the manager reads the latest step's record only then.
    remembers: bool = False

    @abstractmethod
    def should_save(self, ctx: SaveContext) -> bool: ...

    def record(self) -> dict[str, Any] | None:
        """JSON the manager keeps with the step being saved (in its metadata), so that a
        restarted job's policy resumes from it."""
        return None

    def resume(self, record: Mapping[str, Any] | None) -> None:
        """Called once by a manager as it starts, with what `record` gave for the latest
        committed step (None: no step, or one saved without a record)."""
        del record  # a policy that keeps no record has nothing to resume


@dataclass(frozen=True)
class EveryNSteps(SavePolicy):
    """Steps divisible by ``n``."""

    n: int

    def __post_init__(self) -> None:
        _positive("EveryNSteps.n", self.n)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0


@dataclass(frozen=True)
class EveryNSeconds(SavePolicy):
    """The first step at least ``seconds`` after the last save started (and the first step)."""

    seconds: float
    deterministic = False

    def __post_init__(self) -> None:
        _positive("EveryNSeconds.seconds", self.seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.last_time is None or ctx.now - ctx.last_time >= self.seconds


@dataclass(frozen=True)
class AtSteps(SavePolicy):
    """Exactly the given steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(int(s) for s in steps))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps


@dataclass(frozen=True)
class InitialStep(SavePolicy):
    """The first step, when nothing is committed yet (the untrained state)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.last_step is None


@dataclass(frozen=True)
class Continuous(SavePolicy):
    """Whenever the previous save has finished and ``min_interval`` seconds have passed."""

    min_interval: float = 0.0
    deterministic = False

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.in_flight:
            return False
        return ctx.last_time is None or ctx.now - ctx.last_time >= self.min_interval


@dataclass(frozen=True)
class OnPreemption(SavePolicy):
    """The step at which every process learned of a preemption (SIGTERM, or JAX's
    multi-host preemption sync point)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted


@dataclass(frozen=True)
class AnyOf(SavePolicy):
    """Save if any of ``policies`` says so."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ConfigError("AnyOf needs at least one save policy")
        object.__setattr__(self, "policies", tuple(policies))

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return all(p.deterministic for p in self.policies)

    def should_save(self, ctx: SaveContext) -> bool:
        # Every policy is asked (no short cut): one that measures the loop sees every step.
        return any([p.should_save(ctx) for p in self.policies])

    @property
    def remembers(self) -> bool:  # type: ignore[override]
        return any(p.remembers for p in self.policies)

    def record(self) -> dict[str, Any] | None:
        return {"any_of": [p.record() for p in self.policies]}

    def resume(self, record: Mapping[str, Any] | None) -> None:
        kept = record.get("any_of") if isinstance(record, Mapping) else None
        ok = isinstance(kept, list) and len(kept) == len(self.policies)
        for i, p in enumerate(self.policies):
            p.resume(kept[i] if ok and isinstance(kept[i], Mapping) else None)  # type: ignore[index]


class Goodput(SavePolicy):
    """Saves at the interval that loses the least work to saving and to failures.

    A save costs the loop its pause plus the slowdown of the steps that run while it is
    written; a failure loses the work done since the last durable save. With a mean time
    between failures ``M`` and a save cost of ``c`` seconds (measured here), the interval
    between save starts that loses the least is about ``sqrt(2 c M)`` (Young, 1974),
    refined by Daly (2006) to ``sqrt(2 c M) (1 + sqrt(c / (2 M)) / 3 + c / (18 M))`` for
    ``c < 2 M`` (``M`` itself beyond). Never shorter than ``min_interval`` seconds (nor
    longer than ``max_interval``), and the first save waits ``min_interval`` after the
    first step.

    The cost is measured from the loop itself, once per step (the manager asks the policy
    at every ``save`` call): a step's time is the time between two calls; steps with no
    save running give the step time alone; from the call where a save started (it
    includes the pause) to the first call that finds the save finished, what the steps
    took beyond that is the save's cost. The latest costs are averaged with weight
    ``1 - decay`` for the newest, so the interval follows a change in the cost (say
    incremental saves after full ones) within a few saves. `metrics` says what it chose
    and why. One instance per manager: it keeps what it measured.

    Args:
        mtbf: seconds between failures, declared. None (the default): observed from the
            job's own restarts. Each save keeps a record (`record`) of how long the job
            has run and how often it restarted; a manager starting on a root with
            committed steps resumes from the latest step's record, and counts that start
            as one more failure. The job ran past its last save for half an interval on
            average before it failed: that is added. The estimate is the run time per
            failure, and ``prior_mtbf`` (or the run time, if longer) while no restart has
            been seen. Every restart counts, a planned one too: declare ``mtbf`` where
            restarts are planned. The measured save cost resumes from the record too.
        prior_mtbf: the observed estimate before the first restart.
        min_interval, max_interval: bounds on the interval, seconds.
        decay: the weight of the previous average when a new save cost is measured.
    """

    deterministic = False  # clocks: process 0 decides for everyone
    remembers = True

    def __init__(
        self,
        mtbf: float | None = None,
        *,
        prior_mtbf: float = 86_400.0,
        min_interval: float = 60.0,
        max_interval: float | None = None,
        decay: float = 0.5,
    ) -> None:
        if mtbf is not None:
            _positive("Goodput.mtbf", mtbf)
        _positive("Goodput.prior_mtbf", prior_mtbf)
        _positive("Goodput.min_interval", min_interval)
        if max_interval is not None:
            _positive("Goodput.max_interval", max_interval)
            if max_interval < min_interval:
                raise ConfigError("Goodput.max_interval must be at least min_interval")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ConfigError(f"Goodput.decay must be in [0, 1), got {decay!r}")
        self.declared_mtbf = None if mtbf is None else float(mtbf)
        self.prior_mtbf = float(prior_mtbf)
        self.min_interval, self.max_interval = min_interval, max_interval
        self.decay = decay
        self.step_time: float | None = None  # seconds per step without a save running
        self.save_cost: float | None = None  # seconds a save costs the loop
        self.saves_measured = 0
        self.restarts = 0  # failures seen (restarts of the job), from the record resumed
        self._ran_before = 0.0  # seconds the job ran before this manager started
        self._started: float | None = None  # the first call's time
        self._seen: tuple[int, float, float | None, bool] | None = None  # step, now, last, busy
        self._extra: float | None = None  # a save being measured: its cost so far

    def should_save(self, ctx: SaveContext) -> bool:
        self._observe(ctx)
        if ctx.last_time is None:
            assert self._started is not None
            return ctx.now - self._started >= self.min_interval
        return ctx.now - ctx.last_time >= self.interval()

    @property
    def mtbf(self) -> float:
        """Seconds between failures: declared, or observed (the class docstring)."""
        if self.declared_mtbf is not None:
            return self.declared_mtbf
        ran = self.run_seconds()
        return ran / self.restarts if self.restarts else max(self.prior_mtbf, ran)

    def run_seconds(self) -> float:
        """Seconds the job has run: before this manager (from the record) and in it."""
        here = 0.0 if self._seen is None or self._started is None else self._seen[1] - self._started
        return self._ran_before + here

    def interval(self) -> float:
        """Seconds between save starts: Daly's optimum for the measured cost, within the
        bounds (`min_interval` until a save's cost has been measured)."""
        if self.save_cost is None:
            return self.min_interval
        c, m = self.save_cost, self.mtbf
        best = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m))
        best = m if c >= 2 * m else best
        best = max(best, self.min_interval)
        return best if self.max_interval is None else min(best, self.max_interval)

    def record(self) -> dict[str, Any]:
        """What a restarted job's policy resumes from: run time, restarts, the interval,
        and the measured costs."""
        return {
            "run_s": self.run_seconds(),
            "restarts": self.restarts,
            "interval_s": self.interval(),
            "save_cost_s": self.save_cost,
            "step_s": self.step_time,
        }

    def resume(self, record: Mapping[str, Any] | None) -> None:
        """Carry on from the latest step's `record`: one more restart, the run time before
        it (plus half the interval: the job ran past that save before it failed), and the
        costs measured then. Values of the wrong type (another version's record) are
        ignored."""
        if not isinstance(record, Mapping):
            return
        ran, restarts = _seconds(record.get("run_s")), record.get("restarts")
        if ran is None or not isinstance(restarts, int) or isinstance(restarts, bool):
            return
        self.restarts = max(restarts, 0) + 1
        self._ran_before = ran + (_seconds(record.get("interval_s")) or 0.0) / 2
        cost, step = _seconds(record.get("save_cost_s")), _seconds(record.get("step_s"))
        self.save_cost = self.save_cost if cost is None else cost
        self.step_time = self.step_time if step is None else step

    def metrics(self) -> dict[str, float | int | str | None]:
        """What the policy measured and chose: the interval, the save cost and step time
        it was chosen from, the MTBF (and whether it was declared or observed, over how
        long a run and how many restarts), and the expected fraction of time lost to
        saving plus the recomputation after failures, ``c / interval + interval / (2 M)``
        (None until a save's cost is known)."""
        interval = self.interval()
        lost = None
        if self.save_cost is not None:
            lost = self.save_cost / interval + interval / (2 * self.mtbf)
        return {
            "interval_s": interval,
            "save_cost_s": self.save_cost,
            "step_s": self.step_time,
            "mtbf_s": self.mtbf,
            "mtbf_from": "declared" if self.declared_mtbf is not None else "observed",
            "run_s": self.run_seconds(),
            "restarts": self.restarts,
            "saves_measured": self.saves_measured,
            "expected_lost_fraction": lost,
        }

    def _observe(self, ctx: SaveContext) -> None:
        """Fold the time since the previous step's call into the step time or the cost of
        the save running (a repeated call for one step, as `should_save` makes, adds nothing)."""
        seen = self._seen
        if seen is not None and ctx.step <= seen[0]:
            return
        self._seen = (ctx.step, ctx.now, ctx.last_time, ctx.in_flight)
        if seen is None:
            self._started = ctx.now
            return
        step, then, last, busy = seen
        took = (ctx.now - then) / (ctx.step - step)  # seconds per step since the last call
        started = ctx.last_time is not None and ctx.last_time != last
        if started and self._extra is not None:  # back to back: the last one ended as it began
            self._measured(self._extra)
        if started or self._extra is not None:
            extra = (ctx.now - then) - (ctx.step - step) * (self.step_time or took)
            self._extra = (0.0 if started or self._extra is None else self._extra) + extra
            if not ctx.in_flight:  # finished: one more cost measured
                self._measured(self._extra)
        elif not busy and not ctx.in_flight:
            old = self.step_time
            self.step_time = took if old is None else 0.8 * old + 0.2 * took

    def _measured(self, cost: float) -> None:
        """One more save's cost known (a save that ended when the next began, saves back
        to back, counts then): folded into ``save_cost``."""
        cost, self._extra = max(cost, 0.0), None
        old = self.save_cost
        self.save_cost = cost if old is None else self.decay * old + (1 - self.decay) * cost
        self.saves_measured += 1


# ---- keep policies ----


@dataclass(frozen=True)
class StepRecord:
    """A committed step as keep policies see it."""

    step: int
    time: float  # when it was saved (seconds since the epoch)
    metrics: dict[str, Any] = field(default_factory=dict)


class KeepPolicy(ABC):
    """Decides which committed steps are kept; the others are deleted."""

    @abstractmethod
    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]: ...


@dataclass(frozen=True)
class KeepAll(KeepPolicy):
    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        return {r.step for r in records}


@dataclass(frozen=True)
class KeepLatest(KeepPolicy):
    """The ``n`` latest steps."""

    n: int

    def __post_init__(self) -> None:
        _positive("KeepLatest.n", self.n)

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        return {r.step for r in sorted(records, key=lambda r: r.step)[-self.n :]}


@dataclass(frozen=True)
class KeepEveryNSteps(KeepPolicy):
    """Steps divisible by ``n`` (long-term milestones)."""

    n: int

    def __post_init__(self) -> None:
        _positive("KeepEveryNSteps.n", self.n)

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        return {r.step for r in records if r.step % self.n == 0}


@dataclass(frozen=True)
class KeepEveryInterval(KeepPolicy):
    """One step per ``seconds`` of save time (Orbax's ``keep_time_interval``): walking the
    steps oldest first, a step is kept when it was saved at least ``seconds`` after the
    last step kept (the oldest is kept), so a long run keeps a step per hour, say, however
    often it saves. Combine with `KeepAnyOf` (``KeepLatest(n)`` for the recent ones)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("KeepEveryInterval.seconds", self.seconds)

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        kept: set[int] = set()
        last: float | None = None
        for record in sorted(records, key=lambda r: (r.time, r.step)):
            if last is None or record.time - last >= self.seconds:
                kept.add(record.step)
                last = record.time
        return kept


@dataclass(frozen=True)
class KeepBest(KeepPolicy):
    """The ``n`` steps with the best value of ``metric``, and (``keep_without_metric``, the
    default, as Orbax's ``keep_checkpoints_without_metrics``) every step saved without that
    metric: a preemption's or a final save with no evaluation is not dropped for lacking
    one. A step whose metric is not a finite number (NaN) is never among the best."""

    n: int
    metric: str
    mode: Literal["max", "min"] = "max"
    keep_without_metric: bool = True

    def __post_init__(self) -> None:
        _positive("KeepBest.n", self.n)
        if self.mode not in ("max", "min"):
            raise ConfigError(f"KeepBest.mode must be 'max' or 'min', got {self.mode!r}")
        if not isinstance(self.keep_without_metric, bool):
            raise ConfigError(
                f"KeepBest.keep_without_metric must be a bool, got {self.keep_without_metric!r}"
            )

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        best = set(self.ranked(records)[: self.n])
        if self.keep_without_metric:
            best |= {r.step for r in records if self.metric not in r.metrics}
        return best

    def ranked(self, records: Sequence[StepRecord]) -> list[int]:
        """The steps with a finite ``metric``, best first (what `keep` keeps the first
        ``n`` of, and `CheckpointManager.best_step` the first of)."""
        scored = [(r.metrics[self.metric], r.step) for r in records if _number(r, self.metric)]
        scored.sort(reverse=self.mode == "max")
        return [step for _, step in scored]


@dataclass(frozen=True)
class KeepFor(KeepPolicy):
    """Steps saved less than ``seconds`` ago."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("KeepFor.seconds", self.seconds)

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        return {r.step for r in records if now - r.time < self.seconds}


@dataclass(frozen=True)
class KeepAnyOf(KeepPolicy):
    """Keep a step if any of ``policies`` keeps it."""

    policies: tuple[KeepPolicy, ...]

    def __init__(self, *policies: KeepPolicy) -> None:
        if not policies:
            raise ConfigError("KeepAnyOf needs at least one keep policy")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        return set().union(*(p.keep(records, now) for p in self.policies))


def _number(record: StepRecord, metric: str) -> bool:
    value = record.metrics.get(metric)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(what: str, value: float) -> None:
    """A setting that must be a positive, finite number: an infinite interval or count would
    never save (or keep) and poisons what is derived from it (NaN estimates)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive, finite number, got {value!r}")


def _seconds(value: Any) -> float | None:
    """``value`` as a finite, non-negative number of seconds; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
