"""Commit protocol v3: every attempt's fate is decided once.

The interleaving checker (`tests/campaigns/interleave.py`) runs the protocol's actors under chosen
schedules, here bounded (one preemption per pair schedule, a few random walks per triple;
`make races` runs the full exploration). Beside it: that the checker finds a check-then-act
race when there is one, the fate record's own rules, and the untyped leftovers the v3 issue
named (links below an attempt, same-storage tiers).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends import memory
from ckptstore.format import layout
from ckptstore.protocol import ABANDON, COLLECT, COMMIT, Attempt, attempt, fates
from tests.campaigns import interleave
from tests.campaigns.interleave import (
    INCREMENTAL,
    INCREMENTAL_BOUNDED,
    INCREMENTAL_TRIPLES,
    SCENARIOS,
    TRIPLES,
    Scenario,
    Tally,
    World,
)


@pytest.mark.slow
async def test_every_pair_with_one_preemption_and_random_triples_keep_committed_steps() -> None:
    tally = Tally()
    for scenario in SCENARIOS:
        await interleave.explore_pairs(scenario, bound=1, tally=tally)
    for k, scenario in enumerate(TRIPLES):
        await interleave.random_walks(scenario, walks=15, seed=1000 * k, tally=tally)
    failing = [f"{r.scenario}: {r.problems} (schedule {r.schedule})" for r in tally.examples]
    assert tally.failing == 0, "\n".join(failing)
    assert all(tally.per_scenario[s.name][0] >= 1 for s in SCENARIOS)
    assert tally.schedules > 300  # most pairs have many: one per preemption point


@pytest.mark.slow
async def test_incremental_saves_racing_delete_step_and_gc_keep_committed_steps() -> None:
    """An incremental save against `delete_step` of its base (or of the attempt holding
    its bytes) and `gc`: every step an actor was told is committed, and every listed one,
    restores bit-exact and verifies, before and after a `gc` with no grace. Bounded: the
    core races with one preemption, the rest without, a few walks of the triples
    (`python -m tests.campaigns.interleave --only incremental` runs them all)."""
    tally = Tally()
    for k, scenario in enumerate(INCREMENTAL):
        bound = 1 if k < INCREMENTAL_BOUNDED else 0
        await interleave.explore_pairs(scenario, bound=bound, tally=tally)
    for k, scenario in enumerate(INCREMENTAL_TRIPLES):
        await interleave.random_walks(scenario, walks=5, seed=2000 * k, tally=tally)
    failing = [f"{r.scenario}: {r.problems} (schedule {r.schedule})" for r in tally.examples]
    assert tally.failing == 0, "\n".join(failing)
    assert all(tally.per_scenario[s.name][0] >= 1 for s in INCREMENTAL + INCREMENTAL_TRIPLES)
    assert tally.schedules > 70


# ---- the checker can fail: a protocol that checks, then acts ----


async def _check_then_act(world: World) -> None:
    """Create step 1's marker 'if absent', by a read and then a plain write."""
    if not await world.fast.exists("1/COMMITTED"):
        await world.fast.write("1/COMMITTED", interleave._name().encode())
        world.told.append((interleave._name(), 1, None))


async def _one_writer_only(world: World) -> list[str]:
    told = [actor for actor, _, _ in world.told]
    return [f"both {told} were told they created the marker"] if len(told) > 1 else []


async def test_the_checker_finds_a_check_then_act_race() -> None:
    racy = Scenario(
        "check then act",
        interleave.nothing,
        {"a": _check_then_act, "b": _check_then_act},
        check=_one_writer_only,
    )
    original = interleave.check_world

    async def only_the_scenarios_check(world: World, scenario: Scenario) -> list[str]:
        assert scenario.check is not None
        return await scenario.check(world)

    interleave.check_world = only_the_scenarios_check  # type: ignore[assignment]
    try:
        tally = Tally()
        await interleave.explore_pairs(racy, bound=1, tally=tally)
    finally:
        interleave.check_world = original  # type: ignore[assignment]
    assert tally.failing >= 2  # a reads, b reads, then both write (either first)
    assert tally.schedules > tally.failing  # and the schedules without a preemption pass


async def test_the_checker_finds_an_incremental_save_that_skips_its_base_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the commit's re-check of the base (docs/incremental.md, s2), a deletion of
    the base that found no reference yet removes the bytes a committed step reads."""

    async def no_check(backend: Any, base: Any) -> None:
        return None

    monkeypatch.setattr(attempt, "check_base", no_check)
    racy = INCREMENTAL[0]
    assert racy.name == "an incremental save races delete_step of its base"
    tally = Tally()
    await interleave.explore_pairs(racy, bound=1, tally=tally)
    assert tally.failing >= 1
    assert any("does not restore" in p for r in tally.examples for p in r.problems)


# ---- the fate record ----


async def test_a_fate_is_decided_once() -> None:
    backend = memory.MemoryBackend()
    where = layout.AttemptDir(3, layout.new_attempt())
    won = await Attempt(backend, where, "me").claim(COMMIT)
    assert won.kind == COMMIT and not won.dead
    assert (await Attempt(backend, where, "me").claim(COMMIT)).owner == "me"  # a retry
    for kind in (COMMIT, ABANDON, COLLECT):
        with pytest.raises(ckptstore.FencedError, match="claimed for its commit"):
            await Attempt(backend, where, "someone else").claim(kind)
    # Its own commit claim, abandoned after a failed commit, is the owner's to clear.
    assert (await Attempt(backend, where, "me").claim(ABANDON)).kind == COMMIT
    other = layout.AttemptDir(3, layout.new_attempt())
    await Attempt(backend, other, "me").claim(ABANDON)
    with pytest.raises(ckptstore.FencedError, match="abandoned by this same actor"):
        await Attempt(backend, other, "me").claim(COMMIT)
    await backend.write(other.fate, b"not json")
    with pytest.raises(ckptstore.FencedError, match="cannot be read"):
        await Attempt(backend, other, "x").claim(COMMIT)
    assert isinstance(ckptstore.FencedError("x"), ckptstore.AlreadyExistsError)


async def test_a_commit_claim_too_old_is_not_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = memory.MemoryBackend()
    session = await ckptstore.partial_save(backend, 1)
    await session.add({"x": np.arange(3)})
    monkeypatch.setattr(fates, "CLAIM_TTL", 0.0)  # as if half a day passed since the claim
    with pytest.raises(ckptstore.FencedError, match="gc may be collecting it"):
        await session.finalize()
    assert await ckptstore.list_steps(backend) == []


async def test_zombie_finalize_abandon_and_gc_lose_typed(any_backend: ckptstore.Backend) -> None:
    """The three data-loss races of the v3 issue, in the order that used to lose a step."""
    first = await ckptstore.partial_save(any_backend, 5)
    await first.add({"a": np.arange(4.0)})
    zombie = await ckptstore.partial_save(any_backend, 5, attempt=first.attempt)
    await first.finalize()
    with pytest.raises(ckptstore.AlreadyExistsError):  # the step is committed: refused
        await zombie.finalize()
    with pytest.raises(ckptstore.AlreadyExistsError):
        await zombie.abandon()
    assert (await ckptstore.gc(any_backend, older_than=0)).entries == []
    np.testing.assert_array_equal(
        (await ckptstore.restore(any_backend, step=5))["a"], np.arange(4.0)
    )
    assert (await ckptstore.verify(any_backend, step=5)).ok

    # gc decided first: the finalize of the collected session fails typed, commits nothing.
    late = await ckptstore.partial_save(any_backend, 6)
    await late.add({"b": np.arange(2)})
    assert len((await ckptstore.gc(any_backend, older_than=0)).entries) == 1
    with pytest.raises(ckptstore.FencedError, match="garbage-collected"):
        await late.finalize()
    with pytest.raises(ckptstore.FencedError):
        await late.add({"c": np.arange(2)})
    assert await ckptstore.list_steps(any_backend) == [5]
    fresh = await ckptstore.partial_save(any_backend, 6)  # a collected session is not resumed
    assert fresh.attempt != late.attempt and fresh.parts == []


# ---- untyped leftovers ----


async def test_delete_step_and_verify_with_a_link_below_the_attempt(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    await ckptstore.save(str(root), {"w": np.arange(4_000_000, dtype=np.float32)}, step=1)
    (attempt,) = (root / "1").glob("attempt-*")
    data = attempt / "state" / "ocdbt.process_0" / "d"
    outside = tmp_path / "outside"
    data.rename(outside)
    os.symlink(outside, data)
    with pytest.raises(ckptstore.CkptStoreError):
        await ckptstore.restore(str(root), step=1)
    report = await ckptstore.verify(str(root), step=1)  # it does not follow the link either
    assert not report.ok and any("outside" in why for why in report.problems.values())
    await ckptstore.delete_step(str(root), 1)  # the link goes, never what it points to
    assert await ckptstore.list_steps(str(root)) == []
    assert not attempt.exists() and any(outside.iterdir())


@pytest.mark.parametrize(
    "durable", ["{fast}", "file://{fast}", "{fast}/", "{parent}/./fast", "{fast}/inside"]
)
async def test_tiers_on_one_storage_are_a_config_error(tmp_path: Path, durable: str) -> None:
    fast = tmp_path / "fast"
    tiers = ckptstore.Tiered(str(fast), durable.format(fast=fast, parent=tmp_path), keep_fast=1)
    for step in (1, 2):
        with pytest.raises(ckptstore.ConfigError, match="same storage"):
            await ckptstore.save(tiers, {"x": np.arange(3)}, step=step)
    with pytest.raises(ckptstore.ConfigError, match="same storage"):
        ckptstore.CheckpointManager(tiers)
    assert not fast.exists() or not any(fast.rglob("COMMITTED"))


async def test_memory_tiers_on_one_name_are_a_config_error() -> None:
    with pytest.raises(ckptstore.ConfigError, match="same storage"):
        await ckptstore.promote(ckptstore.Tiered("memory://same-tier", "memory://same-tier"))


def test_removing_a_tree_a_writer_adds_to_leaves_what_it_added(tmp_path: Path) -> None:
    """gc racing a writer: a directory that is not empty when removal reaches it stays."""
    from ckptstore.backends import local

    top = tmp_path / "attempt"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "old").write_bytes(b"x")
    real_rmdir = os.rmdir

    def rmdir_after_a_write(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith("/a"):
            (top / "a" / "new").write_bytes(b"y")  # the writer lands a file just then
        real_rmdir(path, *args, **kwargs)

    os.rmdir = rmdir_after_a_write  # type: ignore[assignment]
    try:
        assert local._remove_tree(top) == 1
    finally:
        os.rmdir = real_rmdir
    assert sorted(p.name for p in top.rglob("*")) == ["a", "new"]


def test_the_checker_replays_a_walk_from_its_seed() -> None:
    scenario = TRIPLES[0]

    async def walk() -> list[str]:
        tally = Tally()
        runs: list[Any] = []
        original = interleave.run_schedule

        async def keep(s: Scenario, choose: Any) -> Any:
            run = await original(s, choose)
            runs.append(run)
            return run

        interleave.run_schedule = keep  # type: ignore[assignment]
        try:
            await interleave.random_walks(scenario, walks=1, seed=77, tally=tally)
        finally:
            interleave.run_schedule = original  # type: ignore[assignment]
        return list(runs[0].schedule)

    assert asyncio.run(walk()) == asyncio.run(walk())
