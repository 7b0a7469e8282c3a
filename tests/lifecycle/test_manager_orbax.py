"""The manager on a root a real Orbax 0.12.8 `CheckpointManager` wrote: it lists and restores
Orbax's steps as `list_steps` does, refuses to save beside them (typed, before anything is
written, naming ``ckptstore import-orbax``), and its start-up gc leaves them alone."""

from __future__ import annotations

import logging
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore.cli.main import main as cli_main
from ckptstore.errors import UnsupportedOperationError


def tree(step: int) -> dict[str, Any]:
    return {"w": np.full((4, 4), step, np.float32), "b": np.arange(3, dtype=np.int32) + step}


def orbax_root(root: Path, steps: tuple[int, ...] = (1, 20)) -> None:
    """An Orbax run's root, its files a day old (older than any gc grace)."""
    with ocp.CheckpointManager(root) as manager:
        for step in steps:
            manager.save(step, args=ocp.args.StandardSave(tree(step)))
        manager.wait_until_finished()
    old = time.time() - 86400
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            os.utime(Path(where) / name, (old, old))


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) below ``root``."""
    out: dict[str, bytes | None] = {}
    for where, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(Path(where) / name, root)] = None
        for name in files:
            out[os.path.relpath(Path(where) / name, root)] = (Path(where) / name).read_bytes()
    return out


def assert_tree(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.asarray(got[name]).dtype == value.dtype
        np.testing.assert_array_equal(got[name], value)


def test_manager_reads_orbax_steps_and_refuses_to_save_beside_them(tmp_path: Path) -> None:
    root = tmp_path / "run"
    orbax_root(root)
    before = snapshot(root)
    assert ckptstore.list_steps_sync(root) == [1, 20]
    with ckptstore.CheckpointManager(root) as mgr:  # gc_on_start, 10 min grace: files 1 day old
        assert mgr.all_steps() == [1, 20]
        assert mgr.latest_step() == 20
        assert_tree(mgr.restore(), tree(20))
        assert_tree(mgr.restore(1), tree(1))
        assert_tree(mgr.restore(items={"state": None})["state"], tree(20))
        # The resume idiom: the next save is refused, typed, before anything is staged.
        with pytest.raises(UnsupportedOperationError, match=r"ckptstore import-orbax .* --step 20"):
            mgr.save(21, {"w": np.zeros(2, np.float32)})
        with pytest.raises(UnsupportedOperationError, match="Orbax CheckpointManager root"):
            mgr.save(20, {"w": np.zeros(2, np.float32)}, force=True)
    assert snapshot(root) == before  # nothing written, nothing collected
    # Orbax still reads its own run.
    with ocp.CheckpointManager(root) as manager:
        assert list(manager.all_steps()) == [1, 20]
        assert_tree(manager.restore(20, args=ocp.args.StandardRestore(tree(0))), tree(20))


def test_gc_keeps_orbax_steps_at_any_grace(tmp_path: Path) -> None:
    root = tmp_path / "run"
    orbax_root(root)
    # A step Orbax is still writing (where renames are not atomic: no tmp directory) is
    # Orbax's too: an item directory with _METADATA, no commit_success.txt yet.
    (root / "30" / "default").mkdir(parents=True)
    (root / "30" / "default" / "_METADATA").write_bytes(b"{}")
    before = snapshot(root)
    removed = ckptstore.gc_sync(root, older_than=0)
    assert removed.entries == []
    assert snapshot(root) == before


def test_the_advised_import_resumes_in_a_new_root(tmp_path: Path) -> None:
    root, new = tmp_path / "run", tmp_path / "resumed"
    orbax_root(root)
    ckptstore.import_orbax_sync(root, new, step=20)
    with ckptstore.CheckpointManager(new) as mgr:
        assert mgr.all_steps() == [20]
        state = mgr.restore()
        assert_tree(state, tree(20))
        mgr.save(21, {k: v + 1 for k, v in state.items()})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 21]
    assert ckptstore.list_steps_sync(root) == [1, 20]  # the Orbax run is untouched


def test_an_orbax_root_refuses_the_first_save_whatever_the_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With EveryNSteps(1000) the refusal came 1,000 steps into the job: it is now a warning
    at construction and an error at the first save() (and should_save()), and the command it
    names converts the run."""
    root, new = tmp_path / "run", tmp_path / "resumed"
    orbax_root(root)
    before = snapshot(root)
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    policy = ckptstore.policies.EveryNSteps(1000)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        mgr = ckptstore.CheckpointManager(root, save_policy=policy, options=opts)
    with mgr:
        assert "Orbax CheckpointManager root" in caplog.text and "import-orbax" in caplog.text
        assert_tree(mgr.restore(), tree(20))  # reading stays allowed
        with pytest.raises(UnsupportedOperationError, match="Orbax CheckpointManager root") as e:
            mgr.save(21, tree(21))  # the policy says no to step 21: refused all the same
    assert snapshot(root) == before
    command = re.search(r"`(ckptstore import-orbax [^`]*)`", str(e.value))
    assert command is not None, str(e.value)
    argv = shlex.split(command.group(1).replace("NEW_ROOT", shlex.quote(str(new))))
    assert cli_main(argv[1:]) == 0  # the advised command works as printed
    with ckptstore.CheckpointManager(new, options=opts) as resumed:
        assert resumed.all_steps() == [20]
        assert_tree(resumed.restore(), tree(20))


def test_the_refusal_on_a_root_of_several_items_names_what_converts_all_of_them(
    tmp_path: Path,
) -> None:
    """``import-orbax`` imports every item of a Composite step into one step, so on such a
    run the message gives that command, and the restore of every item after it."""
    root, new = tmp_path / "run", tmp_path / "resumed"
    extra = {"seen": np.arange(5, dtype=np.int64)}
    with ocp.CheckpointManager(root, item_names=("state", "data")) as manager:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(tree(20)), data=ocp.args.StandardSave(extra)
        )
        manager.save(20, args=args)
        manager.wait_until_finished()
    opts = ckptstore.ManagerOptions(handle_sigterm=False)
    with ckptstore.CheckpointManager(root, options=opts) as mgr:
        with pytest.raises(UnsupportedOperationError, match="keeps every item") as e:
            mgr.save(21, tree(21))
    assert "items={'data': None, 'state': None}" in str(e.value)
    command = re.search(r"`(ckptstore import-orbax [^`]*)`", str(e.value))
    assert command is not None, str(e.value)
    argv = shlex.split(command.group(1).replace("NEW_ROOT", shlex.quote(str(new))))
    assert cli_main(argv[1:]) == 0  # the advised command works as printed
    with ckptstore.CheckpointManager(new, options=opts) as resumed:
        items = resumed.restore(20, items={"data": None, "state": None})  # as the message says
        assert_tree(items["state"], tree(20))
        assert_tree(items["data"], extra)
        resumed.save(21, items={"state": tree(21), "data": extra})
        resumed.wait_until_finished()
        assert resumed.all_steps() == [20, 21]
