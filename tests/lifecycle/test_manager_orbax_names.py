"""The Orbax `CheckpointManager` methods an Orbax user reaches for first (`best_step`,
`should_save`, `delete`, `reload`, `metadata`, `item_metadata`, `directory`,
`is_saving_in_progress`, `check_for_errors`), on ckptstore's manager with Orbax 0.12.8's
meanings: where Orbax's answer is checked, against a real Orbax run of the same steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore import policies as pol
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import CheckpointNotFoundError, UnsupportedOperationError
from ckptstore.format.leaves import LeafInfo
from ckptstore.testing.faults import FaultyBackend, InjectedPermanentFault

ACCURACY = {10: 0.9, 20: 0.7, 30: 0.95, 40: 0.6, 50: 0.8}


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((4, 4), step, np.float32), "b": np.arange(3, dtype=np.int32) + step}


def options(**kw: Any) -> ckptstore.ManagerOptions:
    return ckptstore.ManagerOptions(handle_sigterm=False, **kw)


def orbax_best_step(root: Path, mode: str | None) -> int | None:
    """What Orbax's own `best_step` says after saving ``ACCURACY`` (``mode`` None: no
    ``best_fn``), keeping every step."""
    best: dict[str, Any] = {}
    if mode is not None:
        best = {"best_fn": lambda m: m["accuracy"], "best_mode": mode}
    opts = ocp.CheckpointManagerOptions(**best)
    with ocp.CheckpointManager(root, options=opts) as mngr:
        for step, acc in ACCURACY.items():
            mngr.save(step, args=ocp.args.StandardSave(state(step)), metrics={"accuracy": acc})
        mngr.wait_until_finished()
        return mngr.best_step()


@pytest.mark.parametrize("mode", ["max", "min", None])
def test_best_step_matches_orbax(tmp_path: Path, mode: str | None) -> None:
    want = orbax_best_step(tmp_path / "orbax", mode)
    keep: pol.KeepPolicy = pol.KeepAll()
    if mode is not None:  # inside KeepAnyOf, as docs/migrating-from-orbax.md writes it
        best = pol.KeepBest(len(ACCURACY), "accuracy", mode="max" if mode == "max" else "min")
        keep = pol.KeepAnyOf(pol.KeepLatest(1), best)
    with ckptstore.CheckpointManager(tmp_path / "run", keep_policy=keep, options=options()) as mgr:
        assert mgr.best_step() is None  # nothing saved yet, as Orbax
        for step, acc in ACCURACY.items():
            mgr.save(step, state(step), metrics={"accuracy": acc})
        mgr.wait_until_finished()
        assert mgr.best_step() == want == {"max": 30, "min": 40, None: 50}[mode]


def test_best_step_is_none_when_no_step_has_the_metric(tmp_path: Path) -> None:
    keep = pol.KeepBest(1, "accuracy")
    with ckptstore.CheckpointManager(tmp_path / "run", keep_policy=keep, options=options()) as mgr:
        mgr.save(1, state(1), metrics={"loss": 0.3})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1] and mgr.best_step() is None


class GatedCommit(LocalBackend):
    """Holds every commit marker until ``gate`` is set: a save stays in flight exactly as
    long as the test wants, whatever the machine's speed."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    async def _create(self, key: str, data: bytes) -> None:
        if key.endswith("COMMITTED"):
            assert await asyncio.to_thread(self.gate.wait, 60), "the test never opened the gate"
        await super()._create(key, data)


def test_should_save_answers_without_saving(tmp_path: Path) -> None:
    root = tmp_path / "run"
    backend = GatedCommit(root)
    policy = pol.AnyOf(pol.InitialStep(), pol.EveryNSteps(10))
    with ckptstore.CheckpointManager(
        backend, save_policy=policy, options=options(if_busy="skip")
    ) as mgr:
        assert [mgr.should_save(s) for s in (3, 3, 10, 11)] == [True, True, True, True]
        assert not mgr.is_saving_in_progress() and mgr.all_steps() == []
        handle = mgr.save(3, state(3))
        assert handle is not None and mgr.is_saving_in_progress()
        # A save in flight and if_busy="skip": save(10) would skip, so should_save says no.
        assert mgr.should_save(10) is False and mgr.should_save(11) is False
        backend.gate.set()
        handle.wait()
        mgr.wait_until_finished()
        assert not mgr.is_saving_in_progress()
        assert [mgr.should_save(s) for s in (4, 10, 11)] == [False, True, False]
        assert mgr.save(4, state(4)) is None and mgr.save(10, state(10)) is not None
    assert ckptstore.list_steps_sync(root) == [3, 10]


def test_delete_goes_through_the_tiers_and_names_the_steps_there_are(tmp_path: Path) -> None:
    tiers = ckptstore.Tiered(tmp_path / "fast", tmp_path / "durable")
    with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.wait_until_finished()  # promoted: every step is on both tiers
        assert ckptstore.list_steps_sync(tmp_path / "fast") == [1, 2, 3]
        mgr.delete(2)
        assert mgr.all_steps() == [1, 3]
        with pytest.raises(CheckpointNotFoundError, match=r"step 2 .*committed steps: \[1, 3\]"):
            mgr.delete(2)
        mgr.delete(3)  # the latest may go when asked for by name
        assert mgr.latest_step() == 1
    for tier in ("fast", "durable"):
        assert ckptstore.list_steps_sync(tmp_path / tier) == [1]
    assert ckptstore.gc_sync(tiers, older_than=0).entries == []  # nothing left behind


def test_reload_forgets_what_someone_else_changed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    policy = pol.InitialStep()
    keep = pol.KeepBest(3, "accuracy")
    with ckptstore.CheckpointManager(
        root, save_policy=policy, keep_policy=keep, options=options()
    ) as mgr:
        mgr.save(1, state(1), metrics={"accuracy": 0.5}, force=True)
        mgr.save(2, state(2), metrics={"accuracy": 0.4}, force=True)
        mgr.wait_until_finished()
        assert mgr.best_step() == 1 and mgr.should_save(3) is False
        # Another job saves step 2 again, better now.
        ckptstore.delete_step_sync(root, 2)
        ckptstore.save_sync(root, state(2), step=2, metadata={"metrics": {"accuracy": 0.9}})
        assert mgr.best_step() == 1  # the metric read before is kept: what reload is for
        mgr.reload()
        assert mgr.best_step() == 2
        # Another job deletes every step: InitialStep counts from what reload finds.
        ckptstore.delete_step_sync(root, 1)
        ckptstore.delete_step_sync(root, 2)
        assert mgr.should_save(3) is False and mgr.best_step() is None
        mgr.reload()
        assert mgr.should_save(3) is True


@dataclass
class Config:
    model: str
    layers: int


def test_metadata_and_item_metadata_describe_what_is_stored(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        mgr.save(
            7,
            items={"state": state(7), "config": Config("mlp", 2)},
            metrics={"accuracy": 0.9},
            metadata={"run": "a1"},
        )
        mgr.wait_until_finished()
        meta = mgr.metadata(7)
        assert meta.step == 7 and meta.custom_metadata == {"run": "a1"}
        assert meta.metrics == {"accuracy": 0.9} and meta.created > 0
        assert meta.manifest == ckptstore.read_manifest_sync(root, 7)  # what `info` reads
        tree = mgr.item_metadata(7)
        assert sorted(tree) == ["b", "w"] and isinstance(tree["w"], LeafInfo)
        assert (tree["w"].shape, tree["w"].dtype, tree["b"].dtype) == ((4, 4), "float32", "int32")
        assert mgr.item_metadata(7, "config") == {"model": "mlp", "layers": 2}
        like = jax.tree.map(
            lambda i: jax.ShapeDtypeStruct(i.shape, np.dtype(i.dtype)),
            tree,
            is_leaf=lambda x: isinstance(x, LeafInfo),
        )
        np.testing.assert_array_equal(mgr.restore(7, like=like)["w"], state(7)["w"])
        with pytest.raises(CheckpointNotFoundError, match=r"no item 'data'.*\['config', 'state'\]"):
            mgr.item_metadata(7, "data")
        with pytest.raises(CheckpointNotFoundError):
            mgr.metadata(8)


def test_directory(tmp_path: Path) -> None:
    with ckptstore.CheckpointManager(tmp_path / "run", options=options()) as mgr:
        assert mgr.directory == tmp_path / "run"
    with ckptstore.CheckpointManager("memory://orbax-names", options=options()) as mgr:
        assert mgr.directory == "memory://orbax-names"
    tiers = ckptstore.Tiered(tmp_path / "fast", tmp_path / "durable")
    with ckptstore.CheckpointManager(tiers, options=options()) as mgr:
        assert mgr.directory == tmp_path / "durable"


def test_check_for_errors_raises_an_unseen_background_failure_once(tmp_path: Path) -> None:
    root = tmp_path / "run"
    failing = FaultyBackend(
        ckptstore.open_backend(root),
        fail_on={1},
        ops={"create"},
        error="permanent",
        retry=RetryPolicy(max_attempts=1),
    )
    with ckptstore.CheckpointManager(failing, options=options()) as mgr:
        mgr.check_for_errors()  # nothing yet
        handle = mgr.save(1, state(1))
        assert handle is not None
        concurrent.futures.wait([handle._future], timeout=120)
        assert handle.done() and not mgr.is_saving_in_progress()
        with pytest.raises(InjectedPermanentFault):
            mgr.check_for_errors()
        mgr.check_for_errors()  # seen: not raised again
        mgr.save(2, state(2))
    assert ckptstore.list_steps_sync(root) == [2]


def test_an_orbax_root_is_read_only_for_every_new_name(tmp_path: Path) -> None:
    root = tmp_path / "orbax"
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(state(1)))
        mngr.wait_until_finished()
    with ckptstore.CheckpointManager(root, options=options()) as mgr:
        assert mgr.all_steps() == [1] and mgr.best_step() == 1
        with pytest.raises(UnsupportedOperationError, match="Orbax CheckpointManager root"):
            mgr.should_save(2)
        with pytest.raises(UnsupportedOperationError, match="never changes"):
            mgr.delete(1)
        with pytest.raises(UnsupportedOperationError, match=r"ckptstore info .* --step 1"):
            mgr.metadata(1)
        mgr.reload()
        assert mgr.all_steps() == [1]
    assert ckptstore.list_steps_sync(root) == [1]
