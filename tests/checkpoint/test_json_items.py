"""Items that are configuration, not arrays: a dataclass config, a dict of hyperparameters with
strings in it, a run name. Saved as JSON in the manifest beside the arrays, restored as JSON or
into the dataclass ``like=`` names; nothing pickled or evaluated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import CorruptCheckpointError, TreeError, TreeMismatchError
from ckptstore.format.manifest import Manifest


@dataclass
class Optim:
    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass
class Config:
    model: str
    layers: int
    optim: Optim = field(default_factory=Optim)
    tags: list[str] = field(default_factory=list)
    dropout: float | None = None


CFG = Config("nano", 4, Optim(lr=1e-3), ["a", "b"], 0.1)
AS_JSON = {
    "model": "nano",
    "layers": 4,
    "optim": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95]},
    "tags": ["a", "b"],
    "dropout": 0.1,
}
HPARAMS = {"lr": 1e-3, "schedule": "cosine", "warmup": 100, "clip": None, "betas": (0.9, 0.95)}


class Pair(NamedTuple):
    lr: float
    warmup: int


def state() -> dict[str, Any]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 7}


def test_the_manager_saves_configs_beside_the_arrays(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptstore.CheckpointManager(root) as mgr:
        cfg = Config("nano", 4, Optim(lr=1e-3), ["a", "b"], 0.1)
        items = {"state": state(), "config": cfg, "hparams": HPARAMS, "name": "run-42"}
        mgr.save(7, items=items, metadata={"git": "abc123"}).wait()
        cfg.tags.append("changed after save")  # the save took a copy at save()
        out = mgr.restore(items={"state": None, "config": None, "hparams": None, "name": None})
        np.testing.assert_array_equal(out["state"]["w"], state()["w"])
        assert out["config"] == AS_JSON  # without like: JSON (tuples as lists)
        assert out["hparams"] == {**HPARAMS, "betas": [0.9, 0.95]}
        assert out["name"] == "run-42"
        assert mgr.restore(item="config", like=Config) == CFG  # a class: its field types
        assert mgr.restore(item="config", like=CFG) == CFG  # an instance: its values' types
        assert mgr.restore(item="hparams", like=HPARAMS) == HPARAMS
    manifest = ckptstore.read_manifest_sync(root)
    assert manifest.metadata == {"git": "abc123"}
    assert sorted(manifest.items) == ["state"] and manifest.item_names == [
        "config",
        "hparams",
        "name",
        "state",
    ]
    assert manifest.json_items["config"].type == f"{__name__}.Config"
    assert ckptstore.verify_sync(root).ok


def test_plain_save_of_a_config_item(tmp_path: Path) -> None:
    ckptstore.save_sync(tmp_path, CFG, step=1, item="config")
    assert ckptstore.restore_sync(tmp_path, item="config") == AS_JSON
    assert ckptstore.restore_sync(tmp_path, item="config", like=Config) == CFG
    with pytest.raises(ckptstore.CheckpointNotFoundError, match=r"it has \['config'\]"):
        ckptstore.restore_sync(tmp_path)
    # The manifest holds plain JSON: readable by anything, evaluated by nothing.
    attempt = next(p for p in (tmp_path / "1").iterdir() if p.is_dir())
    doc = json.loads((attempt / "manifest.json").read_bytes())
    assert doc["json_items"]["config"]["value"] == AS_JSON and doc["items"] == {}


async def test_json_items_are_promoted_with_their_step(tmp_path: Path) -> None:
    tiers = ckptstore.Tiered(str(tmp_path / "fast"), str(tmp_path / "durable"))
    await ckptstore.save(tiers, HPARAMS, step=3, item="hparams")
    await ckptstore.promote(tiers)
    got = await ckptstore.restore(str(tmp_path / "durable"), item="hparams", like=HPARAMS)
    assert got == HPARAMS


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"w": np.ones(2), "name": "x"}, "neither arrays: leaf 'name' is a str.* nor JSON"),
        ({"opt": {1, 2}}, "opt is a set"),
        ({"x": object()}, "x is a object"),
        ({"lr": float("nan"), "name": "x"}, "lr is nan"),
        ({1: "a"}, "int key"),
        ("x" * (2 << 20), "more than 1048576"),
    ],
)
def test_what_is_neither_arrays_nor_json_is_refused(tmp_path: Path, value: Any, why: str) -> None:
    with pytest.raises(TreeError, match=why):
        ckptstore.save_sync(tmp_path, value, step=1, item="config")
    with ckptstore.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(TreeError, match=why):
            mgr.save(1, items={"state": state(), "config": value})
        assert mgr.all_steps() == []
    assert ckptstore.list_steps_sync(tmp_path) == []


def test_a_config_that_does_not_fit_like_is_a_mismatch(tmp_path: Path) -> None:
    @dataclass
    class Other:
        model: str

    @dataclass
    class Wider(Config):
        heads: int = 8  # a field added since: its default

    ckptstore.save_sync(tmp_path, CFG, step=1, item="config")
    with pytest.raises(TreeMismatchError, match=r"stored fields \['dropout', 'layers'"):
        ckptstore.restore_sync(tmp_path, item="config", like=Other)
    assert ckptstore.restore_sync(tmp_path, item="config", like=Wider) == Wider(**vars(CFG))
    ckptstore.save_sync(tmp_path, {"model": "m"}, step=2, item="config")
    with pytest.raises(TreeMismatchError, match=r"Config\(\.\.\.\) failed"):
        ckptstore.restore_sync(tmp_path, step=2, item="config", like=Config)  # no layers


def test_hand_edited_json_items_are_corrupt() -> None:
    base = {"format": "ckptstore", "format_version": 2, "step": 1}
    base["attempt"] = "attempt-20250101T000000-000000000000"
    for bad in (
        {"json_items": {"a": {"value": 1}}, "items": {"a": {"structure": {"t": "none"}}}},
        {"json_items": {"../x": {"value": 1}}, "items": {}},
        {"json_items": {"a": {"no value": 1}}, "items": {}},
        {"json_items": {"a": {"value": 1, "type": 5}}, "items": {}},
        {"json_items": [], "items": {}},
    ):
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_bytes(json.dumps({**base, **bad}).encode(), where="test")


def test_python_values_alone_are_a_json_item_and_stay_one(tmp_path: Path) -> None:
    """A dict of floats (a config, or what restoring an Orbax ``JsonSave`` gives) is a JSON
    item, and saving what it restores as makes a JSON item again (it was an array item: so
    ``export-orbax`` wrote it with ``StandardCheckpointHandler`` and Orbax's ``JsonRestore``
    failed). An array anywhere in the tree, or what JSON cannot hold, keeps it arrays."""
    hparams = {"lr": 0.5, "decay": 0.25, "warmup": 100, "ema": True}
    with ckptstore.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, items={"state": state(), "config": hparams}).wait()
        again = mgr.restore(1, item="config")
        assert again == hparams and [type(v) for v in again.values()] == [float, float, int, bool]
        mgr.save(2, items={"state": state(), "config": again}).wait()
    for step in (1, 2):
        manifest = ckptstore.read_manifest_sync(tmp_path / "run", step)
        assert sorted(manifest.items) == ["state"], step
        assert manifest.json_items["config"].value == hparams, step
    ckptstore.save_sync(tmp_path / "plain", [0.5, 2], step=1, item="config")
    plain = ckptstore.read_manifest_sync(tmp_path / "plain", 1)
    assert plain.json_items["config"].value == [0.5, 2] and not plain.items

    arrays = {
        "beside an array": {"w": np.ones(2), "lr": 0.5},
        "a numpy scalar": {"lr": np.float32(0.5)},
        "a NaN": {"loss": float("nan")},
        "a complex": {"z": 1j},
        "an int key": {7: 0.5},
        "a named tuple": Pair(0.5, 2),
    }
    for n, (why, value) in enumerate(arrays.items()):
        ckptstore.save_sync(tmp_path / "arrays", value, step=n, item="x")
        stored = ckptstore.read_manifest_sync(tmp_path / "arrays", n)
        assert list(stored.items) == ["x"] and not stored.json_items, why
