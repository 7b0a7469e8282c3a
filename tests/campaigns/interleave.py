"""The interleaving checker: the commit protocol's actors as coroutines on one event loop,
paused before every backend operation, run under schedules chosen on purpose.

Every actor (a save, an incremental save on a base, a partial-save finalize, an abandon,
gc, delete_step, a promotion, a restore, ...) talks to a `GatedBackend`: before each byte
operation it waits at a gate until the scheduler lets it through. The scheduler waits
until every live actor is paused at a gate (or done), then releases exactly one. A
schedule is the sequence of actors released; replaying it gives the same run. What
TensorStore does between two byte operations (writing chunks, a merge) is one step of the
actor that runs it.

Schedules are explored two ways:

- `explore_pairs`: every schedule of two actors with at most ``bound`` preemptions (a
  preemption: releasing another actor while the last one could have gone on), depth
  first, each schedule run from a fresh store (iterative context bounding: races between
  two actors need one or two preemptions);
- `random_walks`: seeded random schedules over three actors; a failing seed replays.

After every schedule the `Scenario`'s invariants are checked on the stores themselves:
a step an actor was told is committed restores bit-exact and verifies (unless a
delete_step of it succeeded), every listed step restores and verifies, every failure an
actor met is a `CkptStoreError`, and what the scenario adds (a deleted step stays deleted).

`python -m tests.campaigns.interleave` runs the full exploration (`make races`); the test suite runs
a bounded one (`tests/campaigns/test_interleave.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import functools
import itertools
import json
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

import ckptstore
from ckptstore.backends import memory
from ckptstore.backends.base import Backend
from ckptstore.testing.faults import FaultyBackend

T = TypeVar("T")

_actor: contextvars.ContextVar[str | None] = contextvars.ContextVar("actor", default=None)

#: Seconds an actor may run between two gates before the run counts as stuck.
STUCK_AFTER = 30.0


class Scheduler:
    """Holds every actor at its next gate; releases one at a time."""

    def __init__(self) -> None:
        self.paused: dict[str, tuple[asyncio.Future[None], str]] = {}
        self.running: set[str] = set()
        self.done: set[str] = set()  # actors whose main task ended (a leftover task of
        # theirs may still pass a gate: it is released, never waited for)
        self._changed = asyncio.Event()
        self._one_at_a_time: dict[str, asyncio.Lock] = {}
        #: (actor, operation) in the order they were released: what happened before what.
        self.log: list[tuple[str, str]] = []

    @contextlib.asynccontextmanager
    async def gate(self, op: str) -> AsyncIterator[None]:
        """Around one byte operation: wait to be released. An actor's operations go one
        at a time (its concurrent tasks queue here), so an actor is either paused at its
        gate, inside one released operation, running code between two, or done."""
        name = _actor.get()
        if name is None:  # set-up and checks run ungated
            yield
            return
        lock = self._one_at_a_time.setdefault(name, asyncio.Lock())
        async with lock:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.paused[name] = (done, op)
            self.running.discard(name)
            self._changed.set()
            try:
                await done
            except asyncio.CancelledError:  # the actor cancelled this task (its sibling failed)
                if self.paused.get(name, (None,))[0] is done:
                    del self.paused[name]
                    self.running.add(name)  # the actor goes on unwinding
                    self._changed.set()
                raise
            yield

    def finished(self, name: str) -> None:
        self.done.add(name)
        self.running.discard(name)
        self._changed.set()

    async def quiescent(self) -> None:
        """Wait until no actor is running (each is paused at a gate, or done)."""
        deadline = time.monotonic() + STUCK_AFTER
        while self.running:
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"actors {sorted(self.running)} never reached a gate")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    def release(self, name: str) -> str:
        done, op = self.paused.pop(name)
        self.log.append((name, op))
        if name not in self.done:
            self.running.add(name)
        done.set_result(None)
        return op


class GatedBackend(FaultyBackend):
    """A backend whose every byte operation first waits at the scheduler's gate."""

    def __init__(self, inner: Backend, scheduler: Scheduler):
        super().__init__(inner)
        self.scheduler = scheduler
        #: While true, every operation that passes the gate fails as an unreachable store
        #: does (`InjectedFault`, transient): an outage (`interleave_outage.py`).
        self.down = False

    async def _around(self, op: str, key: str | None, call: Callable[[], Awaitable[T]]) -> T:
        async with self.scheduler.gate(f"{op} {key}"):
            if self.down:
                self._raise(op, key)
            return await call()


# ---- the world a schedule runs in ----

STEP = 1


def tree(value: float) -> dict[str, Any]:
    """A tiny tree whose every number says who saved it."""
    return {"w": np.full(4, value, np.float32), "b": np.full(2, value + 0.5, np.float32)}


PARTS = [{"w": np.full(4, 7.0, np.float32)}, {"b": np.full(2, 7.5, np.float32)}]
PARTS_TREE = {"w": PARTS[0]["w"], "b": PARTS[1]["b"]}
EXTRA = {"c": np.full(3, 9.0, np.float32)}


@dataclass
class World:
    """The stores of one schedule and what its actors were told."""

    scheduler: Scheduler
    fast: GatedBackend
    durable: GatedBackend
    names: list[str]
    sessions: list[Any] = field(default_factory=list)
    #: Trees a committed step may hold, by step: set-up's and every committer's.
    candidates: dict[int, list[Any]] = field(default_factory=dict)
    #: (actor, step, tree): actors told their save or finalize committed that tree.
    told: list[tuple[str, int, Any]] = field(default_factory=list)
    deleted: set[int] = field(default_factory=set)  # steps a delete_step removed (ok)
    #: (actor, step) of every delete_step that succeeded.
    deletes: list[tuple[str, int]] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)  # actor -> "ok" or the error
    base_attempt: str = ""  # step 1's attempt as set up (`based`)

    @property
    def tiers(self) -> ckptstore.Tiered:
        return ckptstore.Tiered(fast=self.fast, durable=self.durable)

    @classmethod
    def new(cls, run: int) -> World:
        scheduler = Scheduler()
        names = [f"interleave-{run}-fast", f"interleave-{run}-durable"]
        fast, durable = (GatedBackend(memory.MemoryBackend(name), scheduler) for name in names)
        return cls(scheduler, fast, durable, names)

    def close(self) -> None:
        for name in self.names:
            memory.forget(name)


Actor = Callable[[World], Awaitable[Any]]


@dataclass(frozen=True)
class Scenario:
    """Actors that share something, the state they start from, and extra invariants."""

    name: str
    setup: Callable[[World], Awaitable[None]]
    actors: dict[str, Actor]
    check: Callable[[World], Awaitable[list[str]]] | None = None
    tiered: bool = False  # restores and listings go through both tiers


# ---- actors ----


async def saved(world: World, want: Any, step: int) -> None:
    """Save ``want`` as ``step`` on the fast tier, recording it as a candidate and, once
    committed, what this actor was told."""
    world.candidates.setdefault(step, []).append(want)
    await ckptstore.save(world.fast, want, step=step)
    world.told.append((_name(), step, want))


async def deleted(world: World, target: Any, step: int) -> None:
    """`delete_step` of ``step`` on ``target``, recorded once it succeeded."""
    await ckptstore.delete_step(target, step)
    world.deleted.add(step)
    world.deletes.append((_name(), step))


def save_actor(value: float, step: int = STEP) -> Actor:
    async def act(world: World) -> None:
        await saved(world, tree(value), step)

    return act


def finalize_actor(session_index: int) -> Actor:
    """Finalize a session the set-up opened (several actors may hold the same one)."""

    async def act(world: World) -> None:
        session = world.sessions[session_index]
        await session.finalize()
        world.told.append((_name(), STEP, PARTS_TREE))

    return act


async def abandon_actor(world: World) -> None:
    await world.sessions[0].abandon()


def add_actor(session_index: int) -> Actor:
    """A zombie adding one more part to a session it holds."""

    async def act(world: World) -> None:
        await world.sessions[session_index].add(EXTRA)

    return act


async def resume_actor(world: World) -> None:
    """A successor: resumes the newest open session of the step, adds a part, finalizes."""
    session = await ckptstore.partial_save(world.fast, STEP)
    have = set(session.leaves)
    for part in [*PARTS, EXTRA]:
        if not set(part) & have:
            await session.add(part)
    await session.finalize()
    world.told.append((_name(), STEP, {**PARTS_TREE, **EXTRA}))


def gc_actor(tiered: bool = False) -> Actor:
    async def act(world: World) -> None:
        await ckptstore.gc(world.tiers if tiered else world.fast, older_than=0)

    return act


def delete_actor(tiered: bool = False, step: int = STEP) -> Actor:
    async def act(world: World) -> None:
        await deleted(world, world.tiers if tiered else world.fast, step)

    return act


def delete_then_save_actor(value: float) -> Actor:
    """Another job: deletes step 1 (`ckptstore rm`), then saves it again."""

    async def act(world: World) -> None:
        await deleted(world, world.fast, STEP)
        await saved(world, tree(value), STEP)

    return act


def replace_base_actor(value: float) -> Actor:
    """Another writer replaces base step 1 with other values: delete, then save again."""

    async def act(world: World) -> None:
        await deleted(world, world.fast, STEP)
        frozen_too = {k: np.asarray(v) + value for k, v in frozen().items()}
        await saved(world, {**inc_tree(value), "frozen": frozen_too}, STEP)

    return act


def vouched_actor(step: int, value: float) -> Actor:
    """A manager's incremental save: base step 1, vouching that the frozen leaves are the
    very arrays it saved as step 1's attempt (`incremental.SameObjects`); a base gone is
    a full save, once."""

    async def act(world: World) -> None:
        from ckptstore.api import save_items
        from ckptstore.checkpoint.incremental import SameObjects

        want = inc_tree(value)
        world.candidates.setdefault(step, []).append(want)
        vouched = SameObjects(world.base_attempt, {"state": set(FROZEN_LEAVES)})
        try:
            await save_items(
                world.fast, {"state": want}, step=step, base=STEP, same_objects=vouched
            )
        except ckptstore.BaseStepGoneError:
            await ckptstore.save(world.fast, want, step=step)
        world.told.append((_name(), step, want))

    return act


async def promote_actor(world: World) -> None:
    await ckptstore.promote(world.tiers, step=STEP)


def promote_step_actor(step: int) -> Actor:
    """A promotion of ``step`` (an incremental step: its holders go first)."""

    async def act(world: World) -> None:
        await ckptstore.promote(world.tiers, step=step)

    return act


def restore_actor(tiered: bool = False) -> Actor:
    async def act(world: World) -> None:
        got = await ckptstore.restore(world.tiers if tiered else world.fast, step=STEP)
        if not any(_same(got, want) for want in world.candidates.get(STEP, [])):
            raise AssertionError(f"restore returned a tree no one committed: {got}")

    return act


async def verify_actor(world: World) -> None:
    report = await ckptstore.verify(world.fast, step=STEP)
    if not report.ok:
        world.outcomes["verify-report"] = f"problems {report.problems[:2]}"


def incremental_actor(step: int, base: int, value: float, fallback: bool = False) -> Actor:
    """An incremental save of ``step`` on ``base`` (its frozen leaves are referenced);
    ``fallback``: as the manager does (`ManagerOptions(incremental=True)`), a base gone
    (`BaseStepGoneError`) means the same tree is saved again in full, once."""

    async def act(world: World) -> None:
        want = inc_tree(value)
        world.candidates.setdefault(step, []).append(want)
        try:
            result = await ckptstore.save(world.fast, want, step=step, base=base)
        except ckptstore.BaseStepGoneError:
            if not fallback:
                raise
            result = await ckptstore.save(world.fast, want, step=step)
        else:
            if result.bytes_referenced != frozen_bytes():
                raise AssertionError(f"referenced {result.bytes_referenced} B, not the frozen")
        world.told.append((_name(), step, want))

    return act


def chunk_actor(step: int, base: int, value: float, fallback: bool = False) -> Actor:
    """An incremental save of ``step`` on ``base`` whose table changed in one chunk of
    four: the other three are referenced chunk by chunk (docs/incremental.md, "Chunk
    references"); ``fallback`` as in `incremental_actor`."""

    async def act(world: World) -> None:
        want = chunk_tree(value)
        world.candidates.setdefault(step, []).append(want)
        try:
            result = await ckptstore.save(
                world.fast, want, step=step, base=base, chunk_bytes=CHUNK_BYTES
            )
        except ckptstore.BaseStepGoneError:
            if not fallback:
                raise
            result = await ckptstore.save(world.fast, want, step=step, chunk_bytes=CHUNK_BYTES)
        else:
            if result.bytes_referenced != 3 * CHUNK_BYTES:
                raise AssertionError(f"referenced {result.bytes_referenced} B, not 3 chunks")
        world.told.append((_name(), step, want))

    return act


def declared_actor(step: int, value: float) -> Actor:
    """A save of ``step`` on base step 1 as the set-up saved it (its `SaveResult`, which
    pins the attempt), declaring the table's row 0 the only one changed
    (docs/incremental.md, "Declared changes"): the other chunks take step 1's digests
    unread. A base gone, or saved again by another writer, is a full save, once."""

    async def act(world: World) -> None:
        from ckptstore.checkpoint.save import SaveResult

        want = chunk_tree(value)
        world.candidates.setdefault(step, []).append(want)
        base = SaveResult(STEP, world.base_attempt, 0, 0, 0.0, 0.0)
        try:
            await ckptstore.save(
                world.fast,
                want,
                step=step,
                base=base,
                changed={"table": [0]},
                chunk_bytes=CHUNK_BYTES,
            )
        except ckptstore.BaseStepGoneError:
            await ckptstore.save(world.fast, want, step=step, chunk_bytes=CHUNK_BYTES)
        world.told.append((_name(), step, want))

    return act


def replace_chunk_base_actor(value: float) -> Actor:
    """Another writer replaces base step 1 with a table that differs in every chunk."""

    async def act(world: World) -> None:
        await deleted(world, world.fast, STEP)
        other = {"table": np.arange(32, dtype=np.float32) + value, "w": np.full(4, value)}
        world.candidates.setdefault(STEP, []).append(other)
        await ckptstore.save(world.fast, other, step=STEP, chunk_bytes=CHUNK_BYTES)
        world.told.append((_name(), STEP, other))

    return act


def _name() -> str:
    return str(_actor.get())


# ---- set-ups ----


async def nothing(world: World) -> None:
    return None


async def committed(world: World) -> None:
    want = tree(1.0)
    world.candidates[STEP] = [want]
    await ckptstore.save(world.fast, want, step=STEP)


async def promoted_half(world: World) -> None:
    """Committed on the fast tier (not promoted yet)."""
    await committed(world)


async def session_twice(world: World) -> None:
    """One partial-save session with two parts, held by two actors (a job and its zombie)."""
    world.candidates[STEP] = [PARTS_TREE, {**PARTS_TREE, **EXTRA}]
    first = await ckptstore.partial_save(world.fast, STEP)
    for part in PARTS:
        await first.add(part)
    world.sessions = [
        first,
        await ckptstore.partial_save(world.fast, STEP, attempt=first.attempt),
    ]


@functools.cache
def frozen() -> dict[str, Any]:
    """The leaves an incremental save finds unchanged: a small one (packed) and, where
    there are several devices, one sharded over them (chunks in the OCDBT store; `main`
    asks for 8 CPU devices, as the test suite's conftest does)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    data = np.arange(2 * len(devices), dtype=np.float32)
    sharded = jax.device_put(data, NamedSharding(mesh, PartitionSpec("x")))
    return {"packed": np.arange(6, dtype=np.int32), "sharded": sharded}


def frozen_bytes() -> int:
    return sum(int(np.asarray(v).nbytes) for v in frozen().values())


def inc_tree(value: float) -> dict[str, Any]:
    """A LoRA-like tiny tree: the frozen leaves, and one that says who saved it."""
    return {"frozen": frozen(), "w": np.full(4, value, np.float32)}


FROZEN_LEAVES = ("frozen/packed", "frozen/sharded")


async def based(world: World) -> None:
    """Step 1 committed in full: the base (and holder) of an incremental save of step 2."""
    want = inc_tree(1.0)
    world.candidates[STEP] = [want]
    world.base_attempt = (await ckptstore.save(world.fast, want, step=STEP)).attempt


async def chained(world: World) -> None:
    """Step 1 in full, step 2 on base 1: step 1's attempt holds step 2's frozen leaves."""
    await based(world)
    want = inc_tree(2.0)
    world.candidates[2] = [want]
    await ckptstore.save(world.fast, want, step=2, base=STEP)


#: The chunk-level tree's table: 32 float32 in chunks of 8 (`CHUNK_BYTES`), of which only
#: the first changes with the saved value.
CHUNK_BYTES = 32


def chunk_tree(value: float) -> dict[str, Any]:
    """A table that changes in its first chunk only, and a leaf that says who saved it."""
    table = np.arange(32, dtype=np.float32)
    table[0] = value
    return {"table": table, "w": np.full(4, value, np.float32)}


async def chunk_based(world: World) -> None:
    """Step 1 committed in full with the chunk-level tree: the holder of the chunks."""
    want = chunk_tree(1.0)
    world.candidates[STEP] = [want]
    await ckptstore.save(world.fast, want, step=STEP, chunk_bytes=CHUNK_BYTES)


async def chunk_pinned(world: World) -> None:
    """`chunk_based`, step 1's attempt kept: what a declared save's base pins."""
    want = chunk_tree(1.0)
    world.candidates[STEP] = [want]
    saved = await ckptstore.save(world.fast, want, step=STEP, chunk_bytes=CHUNK_BYTES)
    world.base_attempt = saved.attempt


async def chunk_chained(world: World) -> None:
    """Step 1 in full, step 2 on base 1 (it wrote one chunk, references three to step 1)."""
    await chunk_based(world)
    want = chunk_tree(2.0)
    world.candidates[2] = [want]
    await ckptstore.save(world.fast, want, step=2, base=STEP, chunk_bytes=CHUNK_BYTES)


# ---- invariants ----


async def check_world(world: World, scenario: Scenario) -> list[str]:
    """What went wrong in a finished schedule (empty: nothing)."""
    problems = [f"{a}: {o}" for a, o in world.outcomes.items() if o.startswith("untyped")]
    target: Any = world.tiers if scenario.tiered else world.fast
    listed = set(await ckptstore.list_steps(target))
    for actor, step, _ in world.told:
        if may_be_gone(world, actor, step):
            continue
        if step not in listed:
            problems.append(f"{actor} was told step {step} committed; it is not listed")
    for step in sorted(listed):
        try:
            got = await ckptstore.restore(target, step=step)
        except ckptstore.CkptStoreError as exc:
            problems.append(f"listed step {step} does not restore: {exc!r}")
            continue
        if not any(_same(got, want) for want in world.candidates.get(step, [])):
            problems.append(f"listed step {step} holds a tree no one committed")
        told = [want for a, s, want in world.told if s == step and not may_be_gone(world, a, s)]
        if told and not any(_same(got, w) for w in told):
            problems.append(f"step {step} holds another tree than the one its saver was told")
        report = await ckptstore.verify(target, step=step)
        if not report.ok:
            problems.append(f"listed step {step} fails verify: {report.problems[:2]}")
    if "verify-report" in world.outcomes and not world.deleted:
        problems.append(f"verify during the schedule: {world.outcomes['verify-report']}")
    if scenario.check is not None:
        problems += await scenario.check(world)
    return problems


def may_be_gone(world: World, saver: str, step: int) -> bool:
    """Whether a delete_step that succeeded may have removed what ``saver`` committed: one
    that began after ``saver`` created the step's marker. A delete that began before (it
    read an older marker) must leave the re-saved step alone."""
    log = world.scheduler.log
    marked = [
        i
        for i, (actor, op) in enumerate(log)
        if actor == saver and op.startswith(f"create {step}/COMMITTED")
    ]
    if not marked:  # no gated marker creation of its own (a promotion's, say): any delete
        return step in world.deleted
    for deleter, deleted in world.deletes:
        began = next((i for i, (actor, _) in enumerate(log) if actor == deleter), len(log))
        if deleted == step and began > marked[-1]:
            return True
    return False


async def stays_deleted(world: World) -> list[str]:
    """A step delete_step removed (and nobody saved again) is on neither tier."""
    if STEP not in world.deleted:
        return []
    out = []
    for backend in (world.fast.inner, world.durable.inner):
        if STEP in await ckptstore.list_steps(backend):
            out.append(f"step {STEP} was deleted but is listed again on {backend.url}")
    return out


async def survives_gc(world: World) -> list[str]:
    """After the schedule, a `gc` with no grace (ungated) keeps whatever a committed step
    references: every listed step still restores bit-exact and verifies. And a save told
    it committed references the attempt that first wrote the frozen leaves: no chains."""
    await ckptstore.gc(world.fast.inner, older_than=0)
    out = []
    for step in await ckptstore.list_steps(world.fast.inner):
        try:
            got = await ckptstore.restore(world.fast.inner, step=step)
        except ckptstore.CkptStoreError as exc:
            out.append(f"after gc, step {step} does not restore: {exc!r}")
            continue
        if not any(_same(got, want) for want in world.candidates.get(step, [])):
            out.append(f"after gc, step {step} holds a tree no one committed")
        if not (await ckptstore.verify(world.fast.inner, step=step)).ok:
            out.append(f"after gc, step {step} fails verify")
        manifest = await ckptstore.read_manifest(world.fast.inner, step)
        if any(r.step != STEP for r in manifest.references):
            out.append(f"step {step} references {manifest.references}, not step {STEP}'s holder")
    return out


async def survives_gc_on_tiers(world: World) -> list[str]:
    """After the schedule, a `gc` of both tiers with no grace keeps whatever a committed
    step on either tier references: each tier's listed steps restore bit-exact from that
    tier alone and verify there (a promoted incremental step reads its holder's durable
    copy, never the fast tier's)."""
    await ckptstore.gc(world.tiers, older_than=0)
    out = []
    for backend in (world.fast.inner, world.durable.inner):
        for step in await ckptstore.list_steps(backend):
            try:
                got = await ckptstore.restore(backend, step=step)
            except ckptstore.CkptStoreError as exc:
                out.append(f"after gc, step {step} does not restore on {backend.url}: {exc!r}")
                continue
            if not any(_same(got, want) for want in world.candidates.get(step, [])):
                out.append(f"after gc, step {step} on {backend.url} holds a tree no one saved")
            if not (await ckptstore.verify(backend, step=step)).ok:
                out.append(f"after gc, step {step} fails verify on {backend.url}")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


# ---- scenarios ----

SCENARIOS = [
    Scenario(
        "zombie and successor finalize one session",
        session_twice,
        {"finalize-a": finalize_actor(0), "finalize-b": finalize_actor(1)},
    ),
    Scenario(
        "abandon races finalize",
        session_twice,
        {"abandon": abandon_actor, "finalize": finalize_actor(1)},
    ),
    Scenario(
        "one session object: finalize and abandon at once",
        session_twice,
        {"abandon": abandon_actor, "finalize": finalize_actor(0)},
    ),
    Scenario("gc races finalize", session_twice, {"gc": gc_actor(), "finalize": finalize_actor(0)}),
    Scenario("gc races a save", nothing, {"gc": gc_actor(), "save": save_actor(2.0)}),
    Scenario(
        "two saves of one step", nothing, {"save-a": save_actor(2.0), "save-b": save_actor(3.0)}
    ),
    Scenario(
        "a successor resumes while the zombie finalizes",
        session_twice,
        {"resume": resume_actor, "finalize": finalize_actor(0)},
    ),
    Scenario(
        "a successor resumes while the zombie abandons",
        session_twice,
        {"resume": resume_actor, "abandon": abandon_actor},
    ),
    Scenario(
        "a zombie adds a part while the successor finalizes",
        session_twice,
        {"add": add_actor(0), "finalize": finalize_actor(1)},
    ),
    Scenario(
        "delete_step races restore",
        committed,
        {"delete": delete_actor(), "restore": restore_actor()},
    ),
    Scenario("delete_step races gc", committed, {"delete": delete_actor(), "gc": gc_actor()}),
    Scenario("verify races gc", committed, {"verify": verify_actor, "gc": gc_actor()}),
    Scenario(
        "delete_step races a save of the same step",
        committed,
        {"delete": delete_actor(), "save": save_actor(2.0)},
    ),
    Scenario("two delete_steps of one step", committed, {"a": delete_actor(), "b": delete_actor()}),
    Scenario(
        "a stale delete_step races another job's delete and re-save",
        committed,
        {"delete": delete_actor(), "rm-and-save": delete_then_save_actor(2.0)},
    ),
    Scenario(
        "delete_step on tiers races a promotion",
        promoted_half,
        {"delete": delete_actor(tiered=True), "promote": promote_actor},
        check=stays_deleted,
        tiered=True,
    ),
    Scenario(
        "two promotions of one step",
        promoted_half,
        {"promote-a": promote_actor, "promote-b": promote_actor},
        tiered=True,
    ),
    Scenario(
        "gc of both tiers races a promotion",
        promoted_half,
        {"gc": gc_actor(tiered=True), "promote": promote_actor},
        tiered=True,
    ),
]

#: Triples for the random walks: each adds a third actor to a race above.
TRIPLES = [
    Scenario(
        "finalize, finalize and gc",
        session_twice,
        {"finalize-a": finalize_actor(0), "finalize-b": finalize_actor(1), "gc": gc_actor()},
    ),
    Scenario(
        "abandon, finalize and gc",
        session_twice,
        {"abandon": abandon_actor, "finalize": finalize_actor(1), "gc": gc_actor()},
    ),
    Scenario(
        "resume, finalize and abandon",
        session_twice,
        {"resume": resume_actor, "finalize": finalize_actor(1), "abandon": abandon_actor},
    ),
    Scenario(
        "two saves and gc",
        nothing,
        {"save-a": save_actor(2.0), "save-b": save_actor(3.0), "gc": gc_actor()},
    ),
    Scenario(
        "delete_step, a promotion and gc on tiers",
        promoted_half,
        {"delete": delete_actor(tiered=True), "promote": promote_actor, "gc": gc_actor(True)},
        check=stays_deleted,
        tiered=True,
    ),
    Scenario(
        "two delete_steps and a re-save of the step",
        committed,
        {"delete-a": delete_actor(), "delete-b": delete_actor(), "save": save_actor(2.0)},
    ),
    Scenario(
        "delete_step, restore and a save",
        committed,
        {"delete": delete_actor(), "restore": restore_actor(), "save": save_actor(2.0)},
    ),
]


#: Incremental saves (docs/incremental.md, "Safety"): a save of step S on base B races
#: `delete_step` of B (or of the attempt B references) and `gc`. Invariants besides
#: `check_world`'s: after a `gc` with no grace every listed step still restores and
#: verifies, and references name the original holder (`survives_gc`). The test suite runs
#: the first `INCREMENTAL_BOUNDED` with one preemption, the others without.
INCREMENTAL = [
    Scenario(
        "an incremental save races delete_step of its base",
        based,
        {"save": incremental_actor(2, STEP, 2.0), "delete": delete_actor()},
        check=survives_gc,
    ),
    Scenario(
        "an incremental save races gc",
        based,
        {"save": incremental_actor(2, STEP, 2.0), "gc": gc_actor()},
        check=survives_gc,
    ),
    Scenario(
        "delete_step of a step an incremental step references races gc",
        chained,
        {"delete": delete_actor(), "gc": gc_actor()},
        check=survives_gc,
    ),
    Scenario(
        "an incremental save falling back to a full one races delete_step of its base",
        based,
        {"save": incremental_actor(2, STEP, 2.0, fallback=True), "delete": delete_actor()},
        check=survives_gc,
    ),
    Scenario(
        "an incremental save on a referencing base races delete_step of the holder",
        chained,
        {"save": incremental_actor(3, 2, 3.0), "delete": delete_actor()},
        check=survives_gc,
    ),
    Scenario(
        "an incremental save on a referencing base races delete_step of that base",
        chained,
        {"save": incremental_actor(3, 2, 3.0), "delete": delete_actor(step=2)},
        check=survives_gc,
    ),
]
INCREMENTAL += [
    Scenario(
        "promoting an incremental step races delete_step of its base on both tiers",
        chained,
        {"promote": promote_step_actor(2), "delete": delete_actor(tiered=True)},
        check=survives_gc_on_tiers,
        tiered=True,
    ),
    Scenario(
        "promoting an incremental step races gc of both tiers",
        chained,
        {"promote": promote_step_actor(2), "gc": gc_actor(tiered=True)},
        check=survives_gc_on_tiers,
        tiered=True,
    ),
    Scenario(
        "promoting an incremental step races promoting its base",
        chained,
        {"promote-step": promote_step_actor(2), "promote-base": promote_actor},
        check=survives_gc_on_tiers,
        tiered=True,
    ),
]
INCREMENTAL += [
    Scenario(
        "a manager's incremental save races another writer replacing its base",
        based,
        {"save": vouched_actor(2, 2.0), "replace": replace_base_actor(5.0)},
        check=survives_gc,
    ),
]
#: Chunk references (docs/incremental.md, "Chunk references"): the same races, with a
#: save that references three chunks of a leaf and writes the fourth.
INCREMENTAL += [
    Scenario(
        "a chunk-referencing save races delete_step of its base",
        chunk_based,
        {"save": chunk_actor(2, STEP, 2.0), "delete": delete_actor()},
        check=survives_gc,
    ),
    Scenario(
        "a chunk-referencing save races gc",
        chunk_based,
        {"save": chunk_actor(2, STEP, 2.0), "gc": gc_actor()},
        check=survives_gc,
    ),
    Scenario(
        "a chunk-referencing save on a chunk-referencing base races delete_step of the holder",
        chunk_chained,
        {"save": chunk_actor(3, 2, 3.0), "delete": delete_actor()},
        check=survives_gc,
    ),
    Scenario(
        "delete_step of a step whose chunks another references races gc",
        chunk_chained,
        {"delete": delete_actor(), "gc": gc_actor()},
        check=survives_gc,
    ),
    Scenario(
        "a declared-rows chunk save races another writer replacing its base",
        chunk_pinned,
        {"save": declared_actor(2, 2.0), "replace": replace_chunk_base_actor(5.0)},
        check=survives_gc,
    ),
]
INCREMENTAL_BOUNDED = 3
INCREMENTAL_TRIPLES = [
    Scenario(
        "a chunk-referencing save falling back, delete_step of its base and gc",
        chunk_based,
        {
            "save": chunk_actor(2, STEP, 2.0, fallback=True),
            "delete": delete_actor(),
            "gc": gc_actor(),
        },
        check=survives_gc,
    ),
    Scenario(
        "promoting an incremental step, delete_step of its base on both tiers and gc",
        chained,
        {
            "promote": promote_step_actor(2),
            "delete": delete_actor(tiered=True),
            "gc": gc_actor(tiered=True),
        },
        check=survives_gc_on_tiers,
        tiered=True,
    ),
    Scenario(
        "an incremental save, delete_step of its base and gc",
        based,
        {"save": incremental_actor(2, STEP, 2.0), "delete": delete_actor(), "gc": gc_actor()},
        check=survives_gc,
    ),
    Scenario(
        "an incremental save, delete_step of its base and of the holder, and gc",
        chained,
        {
            "save": incremental_actor(3, 2, 3.0),
            "delete-base": delete_actor(step=2),
            "delete-holder": delete_actor(),
            "gc": gc_actor(),
        },
        check=survives_gc,
    ),
]


# ---- running schedules ----

_runs = itertools.count()


@dataclass
class Run:
    """One schedule's outcome."""

    scenario: str
    schedule: list[str]
    enabled: list[list[str]]  # at each decision, the actors that could go
    problems: list[str]


Chooser = Callable[[list[str], list[str]], str]


async def run_schedule(scenario: Scenario, choose: Chooser) -> Run:
    """Run ``scenario`` once, ``choose(enabled, schedule_so_far)`` picking who goes next."""
    world = World.new(next(_runs))
    try:
        await scenario.setup(world)
        tasks = []
        for name, actor in scenario.actors.items():
            world.scheduler.running.add(name)
            context = contextvars.copy_context()
            context.run(_actor.set, name)
            task = asyncio.create_task(_outcome(world, name, actor), context=context)
            task.add_done_callback(lambda _, n=name: world.scheduler.finished(n))
            tasks.append(task)
        schedule: list[str] = []
        enabled: list[list[str]] = []
        while True:
            await world.scheduler.quiescent()
            ready = sorted(world.scheduler.paused)
            if not ready:
                break
            pick = choose(ready, schedule)
            schedule.append(pick)
            enabled.append(ready)
            world.scheduler.release(pick)
        await asyncio.gather(*tasks)
        problems = await check_world(world, scenario)
        return Run(scenario.name, schedule, enabled, problems)
    finally:
        for session in world.sessions:
            await session.close()
        world.close()


async def _outcome(world: World, name: str, actor: Actor) -> None:
    try:
        await actor(world)
        world.outcomes[name] = "ok"
    except ckptstore.CkptStoreError as exc:
        world.outcomes[name] = f"typed {type(exc).__name__}"
    except Exception as exc:  # an untyped error is a finding
        world.outcomes[name] = f"untyped {type(exc).__name__}: {exc}"


def following(prefix: Sequence[str]) -> Chooser:
    """Follow ``prefix``; then keep the last actor going while it can (no preemption)."""

    def choose(ready: list[str], so_far: list[str]) -> str:
        if len(so_far) < len(prefix):
            want = prefix[len(so_far)]
            if want in ready:
                return want
        if so_far and so_far[-1] in ready:
            return so_far[-1]
        return ready[0]

    return choose


def preemptions(schedule: Sequence[str], enabled: Sequence[Sequence[str]]) -> int:
    """Switches to another actor while the previous one could have gone on."""
    return sum(
        1
        for i in range(1, len(schedule))
        if schedule[i] != schedule[i - 1] and schedule[i - 1] in enabled[i]
    )


@dataclass
class Tally:
    schedules: int = 0
    failing: int = 0
    examples: list[Run] = field(default_factory=list)
    per_scenario: dict[str, list[int]] = field(default_factory=dict)  # [schedules, failing]

    def add(self, run: Run) -> None:
        self.schedules += 1
        counts = self.per_scenario.setdefault(run.scenario, [0, 0])
        counts[0] += 1
        if run.problems:
            self.failing += 1
            counts[1] += 1
            if len(self.examples) < 20:
                self.examples.append(run)


async def explore_pairs(
    scenario: Scenario, bound: int, tally: Tally, limit: int | None = None
) -> None:
    """Every schedule of ``scenario`` with at most ``bound`` preemptions (depth first,
    each prefix extended without preemption; ``bound < 0``: every schedule), or the first
    ``limit`` of them."""
    stack: list[list[str]] = [[]]
    seen: set[tuple[str, ...]] = set()
    while stack and (limit is None or tally.per_scenario.get(scenario.name, [0])[0] < limit):
        prefix = stack.pop()
        run = await run_schedule(scenario, following(prefix))
        key = tuple(run.schedule)
        if key in seen:
            continue
        seen.add(key)
        tally.add(run)
        for i in range(len(prefix), len(run.schedule)):
            for other in run.enabled[i]:
                if other == run.schedule[i]:
                    continue
                alt = [*run.schedule[:i], other]
                if bound < 0 or preemptions(alt, run.enabled[: i + 1]) <= bound:
                    stack.append(alt)


async def random_walks(scenario: Scenario, walks: int, seed: int, tally: Tally) -> None:
    """``walks`` schedules of ``scenario``, each choosing uniformly at every step from
    its own seed (``seed + i``: a failing walk replays from it)."""
    for i in range(walks):
        rng = random.Random(seed + i)

        def choose(ready: list[str], so_far: list[str], rng: random.Random = rng) -> str:
            return rng.choice(ready)

        run = await run_schedule(scenario, choose)
        if run.problems:
            run.problems.append(f"replay: seed {seed + i}")
        tally.add(run)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # `frozen`
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--bound", type=int, default=2, help="preemptions per pair schedule (-1: no bound)"
    )
    parser.add_argument("--walks", type=int, default=20000, help="random walks per triple")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run scenarios whose name contains this")
    parser.add_argument("--out", default="", help="write the tally as JSON here")
    args = parser.parse_args(argv)
    tally = Tally()
    start = time.perf_counter()

    from tests.campaigns.interleave_outage import OUTAGE, OUTAGE_TRIPLES

    async def everything() -> None:
        for scenario in [*SCENARIOS, *INCREMENTAL, *OUTAGE]:
            if args.only in scenario.name:
                await explore_pairs(scenario, args.bound, tally)
                _progress(scenario.name, tally, start)
        for k, scenario in enumerate([*TRIPLES, *INCREMENTAL_TRIPLES, *OUTAGE_TRIPLES]):
            if args.only in scenario.name:
                await random_walks(scenario, args.walks, args.seed + k * 1_000_000, tally)
                _progress(scenario.name, tally, start)

    asyncio.run(everything())
    summary = {
        "schedules": tally.schedules,
        "failing": tally.failing,
        "seconds": round(time.perf_counter() - start, 1),
        "bound": args.bound,
        "walks": args.walks,
        "seed": args.seed,
        "scenarios": {
            k: {"schedules": v[0], "failing": v[1]} for k, v in tally.per_scenario.items()
        },
        "examples": [
            {"scenario": r.scenario, "schedule": r.schedule, "problems": r.problems}
            for r in tally.examples
        ],
    }
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if tally.failing else 0


def _progress(name: str, tally: Tally, start: float) -> None:
    done, bad = tally.per_scenario.get(name, [0, 0])
    print(
        f"[{time.perf_counter() - start:7.1f} s] {name}: {done} schedules, {bad} failing",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
