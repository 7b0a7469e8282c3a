"""``manager.save(step, state, changed={leaf: rows})``: the rows each step's update touched,
given on every call, saving or not; a save hashes only the chunks holding the rows named
since its base (ckptstore/lifecycle/changes.py; docs/incremental.md, "Declared changes")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import ckptstore
from ckptstore.lifecycle import policies as P
from ckptstore.lifecycle.changes import ChangedRows

CHUNK = 4096  # chunks of 32 x 32 of a 1024 x 64 float32 table: 2 across each row


def options(**kw: Any) -> ckptstore.ManagerOptions:
    return ckptstore.ManagerOptions(
        incremental=True, chunk_bytes=CHUNK, handle_sigterm=False, gc_on_start=False, **kw
    )


def table() -> np.ndarray[Any, Any]:
    return np.random.default_rng(0).standard_normal((1024, 64), dtype=np.float32)


def test_rows_named_since_the_base_are_saved_across_steps_not_saved(tmp_path: Path) -> None:
    """Saves every 2 steps: step 4's save declares the rows of steps 3 and 4; what each
    step stores is the table; only the chunks of those rows are written."""
    values = table()
    every2 = options(save_policy=P.EveryNSteps(2))
    with ckptstore.CheckpointManager(tmp_path / "run", options=every2) as mgr:
        mgr.save(0, {"emb": jax.device_put(values)}, changed={"emb": []})  # the first base
        mgr.wait_until_finished()
        for step in (1, 2, 3, 4):
            values = values.copy()
            values[200 * step] += 1.0
            handle = mgr.save(step, {"emb": jax.device_put(values)}, changed={"emb": [200 * step]})
            if step % 2:
                assert handle is None
                continue
            assert handle is not None
            assert handle.wait().bytes_written == 2 * 2 * CHUNK  # two rows: 4 chunks
            np.testing.assert_array_equal(mgr.restore(step)["emb"], values)


def test_the_declaration_is_what_the_save_uses(tmp_path: Path) -> None:
    """A row changed but not declared keeps the base's value (the contract, and the proof
    that only declared chunks are read), while the declared one is saved."""
    values = table()
    with ckptstore.CheckpointManager(tmp_path / "run", options=options()) as mgr:
        mgr.save(1, {"emb": jax.device_put(values)})
        mgr.wait_until_finished()
        later = values.copy()
        later[5] += 1.0
        later[600] += 1.0
        mgr.save(2, {"emb": jax.device_put(later)}, changed={"emb": [600]})
        mgr.wait_until_finished()
        got = mgr.restore(2)["emb"]
    np.testing.assert_array_equal(got[600], later[600])
    np.testing.assert_array_equal(got[5], values[5])


@pytest.mark.parametrize("case", ["a call names nothing", "a base found on disk"])
def test_where_the_rows_cannot_be_known_the_leaf_is_hashed(tmp_path: Path, case: str) -> None:
    """A call that named nothing (what did that step change?), or a base this manager did
    not save (its attempt unknown): the declaration is not used, and an undeclared change
    is saved all the same."""
    values = table()
    later = values.copy()
    later[5] += 1.0
    later[600] += 1.0
    root = tmp_path / "run"
    every2 = options(save_policy=P.EveryNSteps(2))
    with ckptstore.CheckpointManager(root, options=every2) as mgr:
        mgr.save(0, {"emb": jax.device_put(values)})
        mgr.wait_until_finished()
        if case == "a call names nothing":
            assert mgr.save(1, {"emb": jax.device_put(later)}) is None
            mgr.save(2, {"emb": jax.device_put(later)}, changed={"emb": [600]})
            mgr.wait_until_finished()
            np.testing.assert_array_equal(mgr.restore(2)["emb"], later)
            return
    with ckptstore.CheckpointManager(root, options=every2) as mgr:
        mgr.save(2, {"emb": jax.device_put(later)}, changed={"emb": [600]})
        mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(2)["emb"], later)


def test_bad_declarations_are_config_errors_at_the_call(tmp_path: Path) -> None:
    plain = ckptstore.ManagerOptions(handle_sigterm=False, gc_on_start=False)
    with ckptstore.CheckpointManager(tmp_path / "plain", options=plain) as mgr:
        with pytest.raises(ckptstore.ConfigError, match="incremental manager"):
            mgr.save(1, {"emb": table()}, changed={"emb": [1]})
    with ckptstore.CheckpointManager(tmp_path / "run", options=options()) as mgr:
        mgr.save(1, {"emb": table()})
        mgr.wait_until_finished()
        with pytest.raises(ckptstore.ConfigError, match="integer row indices"):
            mgr.save(2, {"emb": table()}, changed={"emb": [0.5]})
        with pytest.raises(ckptstore.ConfigError, match="which the tree does not have"):
            mgr.save(2, {"emb": table()}, changed={"nope": [1]})
        with pytest.raises(ckptstore.ConfigError, match="row 1024 is outside"):
            mgr.save(3, {"emb": table()}, changed={"emb": [1024]})
        assert mgr.all_steps() == [1]


def test_periods_join_when_a_save_does_not_commit_and_drop_when_it_does() -> None:
    trees = {"s": {"t": np.zeros((10, 2)), "u": np.zeros(3)}}
    rows = ChangedRows()
    rows.add({"t": [1]}, "s", trees)
    assert rows.take(1, None)["s"]["t"].tolist() == [1]
    rows.add({"t": [2]}, "s", trees)
    rows.add({"t": [3, 2]}, "s", trees)
    assert rows.take(3, 1)["s"]["t"].tolist() == [2, 3]  # step 1 committed: its rows dropped
    rows.add({"t": [4]}, "s", trees)
    # Step 3's save failed (the base is still 1): its rows join this period's.
    assert rows.take(4, 1)["s"]["t"].tolist() == [2, 3, 4]
    rows.add({"u": [0]}, "s", trees)  # a call that does not name "t": "t" is not declared
    got = rows.take(5, 4)
    assert list(got["s"]) == ["u"] and got["s"]["u"].tolist() == [0]
    rows.add(None, "s", trees)
    rows.add({"s": {"t": [7]}}, None, trees)
    assert rows.take(7, 5) == {}  # one call of the two named nothing
    for bad, message in (([[1]], "1-d sequence"), ([10], "row 10 is outside")):
        with pytest.raises(ckptstore.ConfigError, match=message):
            rows.add({"t": bad}, "s", trees)
    rows.add({"t": [2]}, "s", trees)
    assert rows.take(8, 7)["s"]["t"].tolist() == [2]  # the refused calls count for nothing


def test_leaf_names_follow_a_tree_whose_structure_changes() -> None:
    """Leaf names are made once per tree structure: a leaf added or removed between calls
    is found, or refused, by its new structure."""
    rows = ChangedRows()
    rows.add({"t": [1]}, "s", {"s": {"t": np.zeros((4, 2))}})
    rows.add({"v": [3]}, "s", {"s": {"t": np.zeros((4, 2)), "v": np.zeros(5)}})
    with pytest.raises(ckptstore.ConfigError, match="which the tree does not have"):
        rows.add({"t": [0]}, "s", {"s": {"v": np.zeros(5)}})
    with pytest.raises(ckptstore.ConfigError, match=r"row 4 is outside 0\.\.3"):
        rows.add({"t": [4]}, "s", {"s": {"t": np.zeros((4, 2)), "v": np.zeros(5)}})
    with pytest.raises(ckptstore.ConfigError, match=r"row 4 is outside 0\.\.1"):  # same names
        rows.add({"t": [4]}, "s", {"s": {"t": np.zeros((2, 2)), "v": np.zeros(5)}})
