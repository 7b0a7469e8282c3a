"""An Orbax user's run, moved to ckptstore and back (issue 60, item 4): an Orbax
`CheckpointManager` saving Composite steps (a tree, a JSON config of floats) with metrics,
imported, continued by a ckptstore manager with metrics, exported with ``--manager``, and
restored by the user's original Orbax code, metrics and best step included. Real Orbax
0.12.8 on both ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore.cli.main import main
from ckptstore.errors import OrbaxExportError

#: A config of numbers alone: the kind that came back as an array item.
CONFIG = {"lr": 0.5, "decay": 0.25, "warmup": 10}
LOSS = {1: 0.9, 2: 0.4, 3: 0.6, 4: 0.2}


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((4, 2), step, np.float32), "b": np.arange(3, dtype=np.int32) + step}


def orbax_options() -> ocp.CheckpointManagerOptions:
    return ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")


def orbax_restore(mgr: ocp.CheckpointManager, step: int) -> Any:
    """The user's original restore code."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state(0))
    return mgr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), config=ocp.args.JsonRestore()
        ),
    )


def test_the_users_orbax_code_restores_a_run_moved_to_ckptstore_and_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the config came back from ckptstore's save as an array item, exported with
    `StandardCheckpointHandler` (`JsonRestore` failed: no ``config/metadata``), and the
    metrics ckptstore saved were not exported at all (Orbax's ``metrics(step)`` was None)."""
    orbax_run, cs, back = tmp_path / "orbax", tmp_path / "cs", tmp_path / "back"
    with ocp.CheckpointManager(orbax_run, options=orbax_options()) as mgr:
        for step in (1, 2):
            args = ocp.args.Composite(
                state=ocp.args.StandardSave(state(step)), config=ocp.args.JsonSave(CONFIG)
            )
            mgr.save(step, args=args, metrics={"loss": LOSS[step]})
        mgr.wait_until_finished()
    for step in (1, 2):
        ckptstore.import_orbax_sync(orbax_run, cs, step=step)
    with ckptstore.CheckpointManager(cs) as mgr:
        items = mgr.restore(2, items={"state": None, "config": None})
        assert items["config"] == CONFIG
        for step in (3, 4):
            saved = {"state": state(step), "config": items["config"]}
            mgr.save(step, items=saved, metrics={"loss": LOSS[step]})
        mgr.wait_until_finished()
    assert "config" in ckptstore.read_manifest_sync(cs, 4).json_items
    for step in (1, 2, 3):
        ckptstore.export_orbax_sync(cs, back, step=step, manager=True)
    assert main(["export-orbax", str(cs), str(back), "--manager", "--step", "4", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["items"] == ["config", "state"] and done["metrics"] is True

    with ocp.CheckpointManager(back, options=orbax_options()) as mgr:
        assert mgr.all_steps() == [1, 2, 3, 4]
        for step in (1, 2, 3, 4):
            got = orbax_restore(mgr, step)
            assert got["config"] == CONFIG, step
            np.testing.assert_array_equal(np.asarray(got["state"]["w"]), state(step)["w"])
            assert mgr.metrics(step) == {"loss": LOSS[step]}, step
        assert mgr.best_step() == 4
        # The run goes on in Orbax, as it did before the move.
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state(5)), config=ocp.args.JsonSave(CONFIG)
        )
        mgr.save(5, args=args, metrics={"loss": 0.1})
        mgr.wait_until_finished()
        assert mgr.best_step() == 5
    step_dir = back / "4"
    assert json.loads((step_dir / "metrics" / "metrics").read_text()) == {"loss": LOSS[4]}
    handlers = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert sorted(handlers) == ["config", "metrics", "state"]
    assert handlers["config"].endswith("JsonCheckpointHandler")


def test_one_tree_with_metrics_exports_as_orbaxs_default_item(tmp_path: Path) -> None:
    """A step of one array item and metrics goes out as Orbax's own single-item step with
    metrics (``default/`` and ``metrics/``): ``restore(step)`` and ``best_step()`` work."""
    cs, back = tmp_path / "cs", tmp_path / "back"
    with ckptstore.CheckpointManager(cs) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step), metrics={"loss": LOSS[step]})
        mgr.wait_until_finished()
    for step in (1, 2):
        result = ckptstore.export_orbax_sync(cs, back, step=step, manager=True)
        assert result.metrics and result.items == ()
    assert sorted(p.name for p in (back / "2").iterdir() if p.is_dir()) == ["default", "metrics"]
    with ocp.CheckpointManager(back, options=orbax_options()) as mgr:
        got = mgr.restore(2)
        np.testing.assert_array_equal(np.asarray(got["w"]), state(2)["w"])
        assert mgr.metrics(1) == {"loss": LOSS[1]} and mgr.best_step() == 2
    # A plain directory has no place for metrics: the tree alone, as before.
    plain = ckptstore.export_orbax_sync(cs, tmp_path / "plain", step=2)
    assert not plain.metrics and not (tmp_path / "plain" / "metrics").exists()


@pytest.mark.parametrize("name", ["metrics", "default"])
def test_an_item_under_a_name_orbax_reserves_is_refused_with_manager(
    tmp_path: Path, name: str
) -> None:
    """An array item named ``metrics`` (Orbax's manager reads that as the step's metrics,
    JSON) or ``default`` beside other items (a step of one tree to Orbax's manager) is
    refused before anything is written; without --manager it is an item like any other."""
    cs = tmp_path / "cs"
    with ckptstore.CheckpointManager(cs) as mgr:
        mgr.save(1, items={"state": state(1), name: {"x": np.ones(2, np.float32)}}).wait()
    with pytest.raises(OrbaxExportError, match=rf"{name!r}.*without --manager"):
        ckptstore.export_orbax_sync(cs, tmp_path / "back", manager=True)
    assert not (tmp_path / "back").exists()
    ckptstore.export_orbax_sync(cs, tmp_path / "plain")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        like = {"x": jax.ShapeDtypeStruct((2,), np.float32)}
        args = ocp.args.Composite(**{name: ocp.args.StandardRestore(like)})
        got = checkpointer.restore(tmp_path / "plain", args=args)
    np.testing.assert_array_equal(np.asarray(got[name]["x"]), np.ones(2, np.float32))


def test_a_json_metrics_item_is_orbaxs_metrics_and_must_agree(tmp_path: Path) -> None:
    """A JSON item ``metrics`` (what import-orbax made of Orbax's metrics) is exported as
    Orbax's metrics; one that is no object, or disagrees with the step's metrics, is
    refused with --manager."""
    cs = tmp_path / "cs"
    with ckptstore.CheckpointManager(cs) as mgr:
        mgr.save(1, items={"state": state(1), "metrics": {"loss": 0.5}}).wait()
        mgr.save(2, items={"state": state(2), "metrics": [0.5]}).wait()
        mgr.save(3, items={"state": state(3), "metrics": {"loss": 0.5}}, metrics={"loss": 1.0})
        mgr.wait_until_finished()
    ckptstore.export_orbax_sync(cs, tmp_path / "back", step=1, manager=True)
    with ocp.CheckpointManager(tmp_path / "back") as orbax_mgr:
        assert orbax_mgr.metrics(1) == {"loss": 0.5}
        np.testing.assert_array_equal(np.asarray(orbax_mgr.restore(1)["w"]), state(1)["w"])
    for step, why in ((2, "is a list"), (3, "has metrics .* and a JSON item")):
        with pytest.raises(OrbaxExportError, match=why):
            ckptstore.export_orbax_sync(cs, tmp_path / "back", step=step, manager=True)
