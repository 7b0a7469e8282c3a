"""Save and keep policies: explicit objects that compose.

Save policies answer "save at this step?" from a `SaveContext`; keep policies answer
"which committed steps stay?" from the list of `StepRecord`s. Combine them with
`AnyOf` and `KeepAnyOf`. The manager never deletes the latest committed step, nor a
step that is still being written, whatever a keep policy says.

    from ckptstore import policies as P
    save_policy = P.AnyOf(P.EveryNSteps(1000), P.EveryNSeconds(1800), P.OnPreemption())
    keep_policy = P.KeepAnyOf(P.KeepLatest(3), P.KeepBest(1, "val_acc", mode="max"))
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
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

    @abstractmethod
    def should_save(self, ctx: SaveContext) -> bool: ...


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
        return any(p.should_save(ctx) for p in self.policies)


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
class KeepBest(KeepPolicy):
    """The ``n`` steps with the best value of ``metric`` (steps without it are not kept)."""

    n: int
    metric: str
    mode: Literal["max", "min"] = "max"

    def __post_init__(self) -> None:
        _positive("KeepBest.n", self.n)
        if self.mode not in ("max", "min"):
            raise ConfigError(f"KeepBest.mode must be 'max' or 'min', got {self.mode!r}")

    def keep(self, records: Sequence[StepRecord], now: float) -> set[int]:
        return set(self.ranked(records)[: self.n])

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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
