"""`CheckpointManager(Tiered(...), options=ManagerOptions(incremental=True))`: each save
lands on the fast tier and references the last step committed there; promotion copies
what a step references once; the keep policy deletes the base step on both tiers while
later steps read it; a base gone from the fast tier makes one full save. Local disk fast
tier; durable tier a second local directory or moto S3."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

import ckptstore
from ckptstore import policies as pol
from ckptstore.checkpoint.cleanup import trim_step
from ckptstore.checkpoint.target import opened
from ckptstore.protocol import load_committed
from ckptstore.runtime.blocking import run
from tests.checkpoint.helpers import shared_target
from tests.lifecycle.helpers import (
    CHANGED,
    FROZEN,
    OVERHEAD,
    assert_bit_exact,
    host,
    options,
)
from tests.lifecycle.incremental_worker import advance, initial, like


@pytest.fixture(params=["local", "s3"])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> ckptstore.Tiered:
    durable = shared_target(request.param, request, tmp_path, "durable")
    return ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=durable)


async def stored_bytes(target: str, prefix: str = "") -> int:
    """Bytes of every object below ``prefix`` on ``target`` (local disk or S3 alike)."""
    async with opened(target) as backend:
        return sum([info.size async for info in backend.list(prefix)])


def references(target: str, step: int) -> list[int]:
    async def read() -> list[int]:
        async with opened(target) as backend:
            return [r.step for r in (await load_committed(backend, step)).references]

    return run(read())


def train(mgr: ckptstore.CheckpointManager, steps: range, state: Any) -> tuple[Any, dict[int, Any]]:
    """Save every step of ``steps``, each waited for; the end state and each step's."""
    expected = {}
    for step in steps:
        state = advance(state, jnp.int32(step))
        expected[step] = host(state)
        handle = mgr.save(step, state)
        assert handle is not None
        handle.wait()
    mgr.wait_until_finished()  # the last promotion and keep policy too
    return state, expected


def assert_restores(tiers: ckptstore.Tiered, expected: dict[int, Any]) -> None:
    """Every step bit-exact and verified from each tier alone."""
    for tier in (tiers.fast, tiers.durable):
        assert isinstance(tier, str)
        for step, want in expected.items():
            assert_bit_exact(ckptstore.restore_sync(tier, step, like()), want)
            assert ckptstore.verify_sync(tier, step).ok, (tier, step)


def test_a_lora_loop_on_tiers_writes_and_promotes_the_changed_bytes(
    tiers: ckptstore.Tiered,
) -> None:
    """Six saves, `KeepLatest(2)`: every save after the first writes the changed bytes on
    the fast tier; the durable tier holds the frozen base once (step 1's attempt, whose
    step the keep policy deleted on both tiers) and steps 5 and 6 restore from each tier."""
    keep = pol.KeepLatest(2)
    with ckptstore.CheckpointManager(tiers, keep_policy=keep, options=options()) as mgr:
        _, expected = train(mgr, range(1, 7), initial())
        stats = list(mgr.stats)
    first, later = stats[0], stats[1:]
    assert first.base is None and first.bytes_written == first.bytes == FROZEN + CHANGED
    for s in later:
        assert (s.base, s.bytes_written, s.bytes_referenced) == (s.step - 1, CHANGED, FROZEN)
    for tier in (tiers.fast, tiers.durable):
        assert ckptstore.list_steps_sync(tier) == [5, 6]
        assert isinstance(tier, str)
        assert references(tier, 6) == [1]  # the original holder, on each tier
        # Step 1 left every listing; its attempt stays for 5 and 6, and nothing else of
        # the run but 5's and 6's own adapters: the base crossed to the durable tier once.
        assert run(stored_bytes(tier, "1/")) >= FROZEN
        total = run(stored_bytes(tier))
        assert FROZEN + 3 * CHANGED <= total <= FROZEN + 3 * CHANGED + 3 * OVERHEAD, (tier, total)
    assert_restores(tiers, {step: expected[step] for step in (5, 6)})
    durable = tiers.durable
    assert isinstance(durable, str)
    ckptstore.gc_sync(durable, older_than=0)  # referenced: kept, whatever the grace
    shutil.rmtree(str(tiers.fast))  # new machines: the durable tier alone
    for step in (5, 6):
        assert_bit_exact(ckptstore.restore_sync(tiers, step, like()), expected[step])


def test_a_base_gone_from_the_fast_tier_means_one_full_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2, the next save's base, is trimmed from the fast tier after its promotion (as
    eviction for room does): step 3 is saved in full, step 4 references step 3 again, and
    every step restores from the tier(s) holding it."""
    tiers = ckptstore.Tiered(str(tmp_path / "nvme"), str(tmp_path / "durable"))
    with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
        state, expected = train(mgr, range(1, 3), initial())

        async def trim() -> None:
            async with opened(str(tiers.fast)) as fast:
                await trim_step(fast, 2)

        run(trim())
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            _, more = train(mgr, range(3, 5), state)
        stats = {s.step: s for s in mgr.stats}
    expected.update(more)
    assert "step 3 saved in full" in caplog.text
    assert stats[2].base == 1 and stats[2].bytes_written == CHANGED
    assert stats[3].base is None and stats[3].bytes_written == stats[3].bytes
    assert stats[4].base == 3 and stats[4].bytes_written == CHANGED
    assert ckptstore.list_steps_sync(str(tiers.fast)) == [1, 3, 4]
    assert ckptstore.list_steps_sync(str(tiers.durable)) == [1, 2, 3, 4]
    assert references(str(tiers.durable), 4) == [3]
    assert_restores(tiers, {s: expected[s] for s in (1, 3, 4)})
    assert_bit_exact(ckptstore.restore_sync(tiers, 2, like()), expected[2])


def test_a_restart_takes_its_base_from_the_fast_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted manager's first save references the latest step committed on the fast
    tier; on new machines (an empty fast tier) it is a full save, without a failed try."""
    tiers = ckptstore.Tiered(str(tmp_path / "nvme"), str(tmp_path / "durable"))
    with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
        state, expected = train(mgr, range(1, 3), initial())
    with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
        state, more = train(mgr, range(3, 4), state)
        assert mgr.stats[0].base == 2 and mgr.stats[0].bytes_written == CHANGED
    expected.update(more)
    shutil.rmtree(tmp_path / "nvme")
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
            _, more = train(mgr, range(4, 6), state)
            first, second = mgr.stats
    expected.update(more)
    assert "saved in full" not in caplog.text
    assert first.base is None and first.bytes_written == first.bytes
    assert second.base == 4 and second.bytes_written == CHANGED
    assert ckptstore.list_steps_sync(str(tiers.durable)) == [1, 2, 3, 4, 5]
    for step, want in expected.items():
        assert_bit_exact(ckptstore.restore_sync(str(tiers.durable), step, like()), want)
