"""An Orbax step missing part of what it saved: an item that ``_CHECKPOINT_METADATA`` lists
(with the handler that wrote it) but whose directory was deleted, lost its ``_METADATA``, or
was replaced by a file. Read in place or imported, such an item is `CorruptCheckpointError`
naming it, never left out without a word (an import exited 0 with the optimizer state
missing, and ``restore()`` of a two-tree step gave the tree that was left)."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore.cli.main import main
from ckptstore.errors import CorruptCheckpointError
from tests.orbax.conftest import assert_bit_exact, saved_form
from tests.orbax.test_orbax_composite import composite_run, model


def _replace_by_file(item: Path) -> None:
    shutil.rmtree(item)
    item.write_bytes(b"not a directory")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "deleted": shutil.rmtree,
    "no-metadata": lambda item: (item / "_METADATA").unlink(),
    "a-file": _replace_by_file,
}
WHAT = {"deleted": "missing", "no-metadata": "no _METADATA", "a-file": "not a directory"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_import_refuses_a_torn_item_and_commits_nothing(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, dst = tmp_path / "run", tmp_path / "cs"
    composite_run(root, steps=(20,))
    DAMAGE[damage](root / "20" / "opt")
    assert main(["import-orbax", str(root), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "'opt'" in err and WHAT[damage] in err
    assert "--item" in err  # how to import the rest on purpose
    assert not dst.exists()  # nothing committed, nothing even begun
    with pytest.raises(CorruptCheckpointError, match=rf"'opt'.*{WHAT[damage]}"):
        ckptstore.import_orbax_sync(root, dst)
    assert not dst.exists()
    # Leaving it out on purpose imports the rest.
    assert main(["import-orbax", str(root), str(dst), "--item", "model"]) == 0
    assert ckptstore.read_manifest_sync(dst, 20).item_names == ["model"]
    assert_bit_exact(ckptstore.restore_sync(dst, item="model"), saved_form(model(20)))


def test_a_torn_item_in_any_step_of_an_all_steps_import_commits_nothing(tmp_path: Path) -> None:
    root, dst = tmp_path / "run", tmp_path / "cs"
    composite_run(root, steps=(10, 20))
    shutil.rmtree(root / "10" / "opt")
    with pytest.raises(CorruptCheckpointError, match=r"step .*10.*'opt'"):
        ckptstore.import_orbax_steps_sync(root, dst)
    assert not dst.exists()  # step 20 is intact, but not imported either


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_reading_in_place_names_a_torn_item(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    composite_run(root, steps=(20,))
    DAMAGE[damage](root / "20" / "opt")
    with pytest.raises(CorruptCheckpointError, match=rf"'opt'.*{WHAT[damage]}"):
        ckptstore.restore_sync(root, item="opt")  # was "no item 'opt'"
    with pytest.raises(CorruptCheckpointError, match="'opt'"):
        ckptstore.restore_sync(root)  # gave the model: the one tree left
    # An intact item named on purpose still reads.
    assert_bit_exact(ckptstore.restore_sync(root, item="model"), saved_form(model(20)))
    with warnings.catch_warnings(action="ignore"), ckptstore.CheckpointManager(root) as mgr:
        with pytest.raises(CorruptCheckpointError, match="'opt'"):
            mgr.restore(20, items={"model": None, "opt": None})
    for command in ("ls", "info", "verify"):
        assert main([command, str(root), "--json"]) == 1, command
        assert "'opt'" in capsys.readouterr().out, command


def test_a_torn_metrics_item_is_named_too(tmp_path: Path) -> None:
    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(root, options=options) as manager:
        manager.save(5, args=ocp.args.StandardSave(model(5)), metrics={"loss": 0.5})
        manager.wait_until_finished()
    shutil.rmtree(root / "5" / "metrics")
    with pytest.raises(CorruptCheckpointError, match=r"'metrics'.*missing"):
        ckptstore.import_orbax_sync(root, tmp_path / "cs")
    assert not (tmp_path / "cs").exists()
    with warnings.catch_warnings(action="ignore"), ckptstore.CheckpointManager(root) as mgr:
        with pytest.raises(CorruptCheckpointError, match="'metrics'"):
            mgr.metrics(5)


@pytest.mark.parametrize(
    "doc",
    [
        b"[1, 2]",
        b'{"item_handlers": {"opt": 3}}',
        b'{"item_handlers": {"../opt": null}}',
        b'{"item_handlers": {"opt": null, "opt": null}}',
    ],
    ids=["not-an-object", "handler-not-a-string", "bad-name", "duplicate"],
)
def test_an_unreadable_checkpoint_metadata_is_corrupt(doc: bytes, tmp_path: Path) -> None:
    root = tmp_path / "run"
    composite_run(root, steps=(20,))
    (root / "20" / "_CHECKPOINT_METADATA").write_bytes(doc)
    with pytest.raises(CorruptCheckpointError, match="_CHECKPOINT_METADATA"):
        ckptstore.import_orbax_sync(root, tmp_path / "cs")
    with pytest.raises(CorruptCheckpointError, match="_CHECKPOINT_METADATA"):
        ckptstore.restore_sync(root)


def test_a_step_without_a_listing_reads_by_what_is_there(tmp_path: Path) -> None:
    """No ``item_handlers`` (an older Orbax, a hand-made step): the items are what the
    directories hold, as before."""
    root = tmp_path / "run"
    composite_run(root, steps=(20,))
    (root / "20" / "_CHECKPOINT_METADATA").write_text(json.dumps({"metrics": {}}))
    result = ckptstore.import_orbax_sync(root, tmp_path / "cs")
    assert sorted(result.items) == ["config", "model", "opt"]
