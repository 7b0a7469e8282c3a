"""Composite Orbax runs (``ocp.args.Composite`` of tree items and a ``JsonSave`` config),
written by real Orbax 0.12.8: read in place (JSON items included), imported whole into one
committed step, and exported back whole for Orbax's own Composite restore."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore.cli.main import main
from ckptstore.errors import CorruptCheckpointError, OrbaxExportError
from ckptstore.runtime.progress import Progress
from tests.orbax.conftest import assert_bit_exact, saved_form


@dataclass
class Config:
    lr: float
    name: str
    layers: tuple[int, ...] = (1,)


CONFIG = {"lr": 0.125, "name": "run-a", "layers": [4, 8]}


def model(step: int) -> dict[str, Any]:
    return {"w": np.full((4, 3), step, np.float32), "b": np.arange(3, dtype=np.int32) + step}


def opt(step: int) -> dict[str, Any]:
    return {"mu": {"w": np.zeros((4, 3), np.float32) + step / 8}, "count": np.int64(step)}


def composite_run(root: Path, steps: tuple[int, ...] = (10, 20)) -> None:
    """An Orbax run whose steps hold a model, an optimizer state and a JSON config."""
    with ocp.CheckpointManager(root) as manager:
        for step in steps:
            args = ocp.args.Composite(
                model=ocp.args.StandardSave(model(step)),
                opt=ocp.args.StandardSave(opt(step)),
                config=ocp.args.JsonSave({**CONFIG, "step": step}),
            )
            manager.save(step, args=args)
        manager.wait_until_finished()


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 0) -> Any:
    assert main([*argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


# ---- reading in place ----


def test_json_items_are_listed_and_restored_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    composite_run(root)
    listed = run_json(["ls", str(root)], capsys)
    assert [s["items"] for s in listed] == [["config", "model", "opt"]] * 2
    shown = run_json(["info", str(root)], capsys)
    assert sorted(shown["items"]) == ["model", "opt"]
    assert shown["json_items"] == {"config": {**CONFIG, "step": 20}}
    assert main(["info", str(root)]) == 0
    assert "item 'config': JSON" in capsys.readouterr().out
    assert run_json(["verify", str(root)], capsys)["ok"]

    assert ckptstore.restore_sync(root, item="config") == {**CONFIG, "step": 10 + 10}
    assert ckptstore.restore_sync(root, step=10, item="config")["step"] == 10
    cfg = ckptstore.restore_sync(root, item="config", like={"lr": 0, "name": "", "layers": (0, 0)})
    assert cfg["layers"] == (4, 8)  # like a ckptstore JSON item: tuples where like has them
    assert_bit_exact(ckptstore.restore_sync(root, item="opt"), saved_form(opt(20)))
    with ckptstore.CheckpointManager(root) as mgr:
        got = mgr.restore(10, items={"model": None, "opt": None, "config": None})
    assert got["config"] == {**CONFIG, "step": 10}
    assert_bit_exact(got["model"], saved_form(model(10)))


def test_a_json_item_restores_into_a_dataclass(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as manager:
        manager.save(1, args=ocp.args.Composite(config=ocp.args.JsonSave(CONFIG)))
        manager.wait_until_finished()
    assert ckptstore.restore_sync(root, item="config", like=Config) == Config(
        0.125, "run-a", (4, 8)
    )


@pytest.mark.parametrize(
    "data",
    [b'{"lr": NaN}', b'{"lr": 1, "lr": 2}', b"[" * 5000 + b"]" * 5000, b"\xff"],
    ids=["nan", "duplicate-key", "deep", "not-utf8"],
)
def test_a_damaged_json_item_is_corrupt(tmp_path: Path, data: bytes) -> None:
    root = tmp_path / "run"
    composite_run(root, steps=(1,))
    (root / "1" / "config" / "metadata").write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="Orbax JSON item"):
        ckptstore.restore_sync(root, item="config")


# ---- import-orbax ----


def test_import_orbax_brings_every_item_into_one_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, dst = tmp_path / "run", tmp_path / "cs"
    composite_run(root)
    done = run_json(["import-orbax", str(root), str(dst), "--step", "20"], capsys)
    assert done["step"] == 20 and done["items"] == {
        "config": "config",
        "model": "model",
        "opt": "opt",
    }
    assert ckptstore.list_steps_sync(dst) == [20]
    manifest = ckptstore.read_manifest_sync(dst, 20)
    assert manifest.item_names == ["config", "model", "opt"]
    assert sorted(manifest.json_items) == ["config"]
    assert_bit_exact(ckptstore.restore_sync(dst, item="model"), saved_form(model(20)))
    assert_bit_exact(ckptstore.restore_sync(dst, item="opt"), saved_form(opt(20)))
    assert ckptstore.restore_sync(dst, item="config", like=dict) == {**CONFIG, "step": 20}
    assert ckptstore.verify_sync(dst, 20).ok

    # --item narrows it to one item, which keeps its name.
    one = ckptstore.import_orbax_sync(root, tmp_path / "one", step=10, item="opt")
    assert one.items == {"opt": "opt"}
    assert ckptstore.read_manifest_sync(tmp_path / "one", 10).item_names == ["opt"]
    assert_bit_exact(ckptstore.restore_sync(tmp_path / "one", item="opt"), saved_form(opt(10)))
    cfg = ckptstore.import_orbax_sync(root, tmp_path / "cfg", item="config", as_step=1)
    assert cfg.items == {"config": "config"} and cfg.leaves == 0
    assert ckptstore.restore_sync(tmp_path / "cfg", 1, item="config")["step"] == 20
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="without --item"):
        ckptstore.import_orbax_sync(root, tmp_path / "none", item="params")


def test_a_single_item_run_still_imports_as_state(tmp_path: Path) -> None:
    """Orbax's one unnamed tree (``default``) becomes "state", the manager's default item,
    as before: restore() and a manager's restore() read it without naming it."""
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as manager:
        manager.save(5, args=ocp.args.StandardSave(model(5)))
        manager.wait_until_finished()
    result = ckptstore.import_orbax_sync(root, tmp_path / "cs")
    assert result.items == {"state": "default"}
    assert_bit_exact(ckptstore.restore_sync(tmp_path / "cs"), saved_form(model(5)))
    with ckptstore.CheckpointManager(tmp_path / "cs") as mgr:
        assert_bit_exact(mgr.restore(), saved_form(model(5)))


class Killed(Exception):
    pass


class KillAfter(Progress):
    """A progress bar that stops the import (as a kill would) once ``leaves`` leaves are in."""

    def __init__(self, leaves: int) -> None:
        super().__init__(enabled=False)
        self.limit = leaves

    def advance(self, items: int, nbytes: int) -> None:
        super().advance(items, nbytes)
        if self.items >= self.limit:
            raise Killed


def test_a_killed_composite_import_commits_nothing_and_resumes(tmp_path: Path) -> None:
    """The items commit together: an import stopped after the first item's parts leaves no
    step, and the next run resumes from the parts the first one recorded."""
    root, dst = tmp_path / "run", tmp_path / "cs"
    composite_run(root, steps=(20,))
    with pytest.raises(Killed):  # the model's 2 leaves are parts, the optimizer's are not
        ckptstore.import_orbax_sync(root, dst, batch_bytes=1, progress=KillAfter(2))
    assert ckptstore.list_steps_sync(dst) == []
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.restore_sync(dst, 20, item="model")
    result = ckptstore.import_orbax_sync(root, dst, batch_bytes=1)
    assert result.skipped == 2 and result.leaves == 2  # the model's parts were kept
    assert ckptstore.list_steps_sync(dst) == [20]
    assert_bit_exact(ckptstore.restore_sync(dst, item="opt"), saved_form(opt(20)))
    assert_bit_exact(ckptstore.restore_sync(dst, item="model"), saved_form(model(20)))
    assert ckptstore.restore_sync(dst, item="config") == {**CONFIG, "step": 20}


# ---- export-orbax ----


def composite_args(like: dict[str, Any]) -> Any:
    return ocp.args.Composite(
        model=ocp.args.StandardRestore(like["model"]),
        opt=ocp.args.StandardRestore(like["opt"]),
        config=ocp.args.JsonRestore(),
    )


def test_export_of_a_step_of_several_items_is_one_composite_step_orbax_restores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --item every item of the step is exported, JSON items included, as one
    Orbax Composite step (it was refused: "export-orbax writes one item"); real Orbax
    restores it as a checkpoint directory and as a CheckpointManager step, and the run
    continues in Orbax."""
    root, cs = tmp_path / "run", tmp_path / "cs"
    composite_run(root, steps=(20,))
    ckptstore.import_orbax_sync(root, cs)
    like = {"model": saved_form(model(20)), "opt": saved_form(opt(20))}
    done = run_json(["export-orbax", str(cs), str(tmp_path / "all")], capsys)
    assert done["items"] == ["config", "model", "opt"] and done["leaves"] == 4
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        got = checkpointer.restore(tmp_path / "all", args=composite_args(like))
    assert got["config"] == {**CONFIG, "step": 20}
    for name in ("model", "opt"):
        assert_bit_exact(jax.tree.map(np.asarray, got[name]), like[name])

    runs = tmp_path / "orbax-run"
    assert main(["export-orbax", str(cs), str(runs), "--manager"]) == 0
    with ocp.CheckpointManager(runs) as manager:
        assert manager.all_steps() == [20]
        got = manager.restore(20, args=composite_args(like))
        assert got["config"] == {**CONFIG, "step": 20}
        assert_bit_exact(jax.tree.map(np.asarray, got["model"]), like["model"])
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(model(30)),
            opt=ocp.args.StandardSave(opt(30)),
            config=ocp.args.JsonSave({**CONFIG, "step": 30}),
        )
        manager.save(30, args=args)
        manager.wait_until_finished()
    assert ckptstore.restore_sync(runs, step=30, item="config")["step"] == 30


def test_export_of_one_item_of_several_is_a_plain_tree(tmp_path: Path) -> None:
    """--item narrows the export to one array item, written as one Orbax tree; a JSON
    item alone is refused, saying how to export it."""
    root, cs = tmp_path / "run", tmp_path / "cs"
    composite_run(root, steps=(20,))
    ckptstore.import_orbax_sync(root, cs)
    with pytest.raises(OrbaxExportError, match=r"JSON item.*no --item"):
        ckptstore.export_orbax_sync(cs, tmp_path / "cfg", item="config")
    assert not (tmp_path / "cfg").exists()
    for name, want in (("model", model(20)), ("opt", opt(20))):
        out = tmp_path / f"orbax-{name}"
        assert main(["export-orbax", str(cs), str(out), "--item", name]) == 0
        got = ocp.StandardCheckpointer().restore(out)
        assert_bit_exact(jax.tree.map(np.asarray, got), saved_form(want))


def test_a_json_item_under_a_file_name_of_its_own_is_read_and_imported(tmp_path: Path) -> None:
    """``JsonCheckpointHandler(filename=...)`` writes the value under another name than
    ``metadata``: the item is still listed, restored in place and imported (it was not an
    item at all: "no item 'config'")."""
    root, cs = tmp_path / "run", tmp_path / "cs"
    handlers = {
        "model": ocp.StandardCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(filename="config.json"),
    }
    with ocp.CheckpointManager(root, item_handlers=handlers) as manager:
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(model(5)), config=ocp.args.JsonSave(CONFIG)
        )
        manager.save(5, args=args)
        manager.wait_until_finished()
    assert (root / "5" / "config" / "config.json").is_file()
    assert ckptstore.restore_sync(root, item="config") == CONFIG
    ckptstore.import_orbax_sync(root, cs)
    assert ckptstore.restore_sync(cs, item="config") == CONFIG
    assert_bit_exact(ckptstore.restore_sync(cs, item="model"), saved_form(model(5)))
