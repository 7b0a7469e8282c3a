"""Typed PRNG keys across the Orbax boundary, with real Orbax 0.12.8: keys Orbax saved restore
in place and import as typed keys of the implementation Orbax recorded, and an export records
each key array's implementation as Orbax does, so Orbax restores typed keys; bit-exact,
sharded or not, every implementation this jax knows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.errors import CorruptCheckpointError, UnsupportedLeafError
from tests.checkpoint.helpers import IMPLS, assert_same_keys, keys_tree, mesh


def sharded_trees() -> dict[str, Any]:
    """Every implementation's keys (and a float array), the batch keys sharded over a mesh."""
    trees = {impl: keys_tree(impl) for impl in IMPLS}
    for tree in trees.values():
        tree["spread"] = jax.device_put(
            jax.random.split(tree["one"], 8), NamedSharding(mesh(), P("x"))
        )
    return trees


def assert_same_tree(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same leaves: keys of the same implementation with the same data (and, where jax can
    draw from them on CPU, the same bits: not philox keys sharded over a mesh), arrays equal."""
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value))
            continue
        if isinstance(value.sharding, NamedSharding):
            assert got[name].dtype == value.dtype
            np.testing.assert_array_equal(
                np.asarray(jax.random.key_data(got[name])), np.asarray(jax.random.key_data(value))
            )
        else:
            assert_same_keys(got[name], value)


def orbax_save(root: Path, tree: Any, step: int = 3) -> None:
    with ocp.CheckpointManager(root) as manager:
        manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()


@pytest.mark.slow
def test_keys_orbax_saved_restore_in_place_and_import_as_typed_keys(tmp_path: Path) -> None:
    trees = sharded_trees()
    orbax_save(tmp_path / "orbax", trees)
    in_place = ckptstore.restore_sync(tmp_path / "orbax")  # no like: typed keys, as recorded
    on = NamedSharding(mesh(), P())  # replicated over the whole mesh
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), trees)
    onto_mesh = ckptstore.restore_sync(tmp_path / "orbax", like=like)
    ckptstore.import_orbax_sync(tmp_path / "orbax", tmp_path / "imported")
    imported = ckptstore.restore_sync(tmp_path / "imported", step=3)
    for impl, tree in trees.items():
        for restored in (in_place, imported):
            assert_same_tree(restored[impl], tree)
        for name, want in tree.items():  # on the mesh: the data (jax cannot draw philox
            got = onto_mesh[impl][name]  # bits from mesh-sharded keys on CPU)
            assert got.dtype == want.dtype and got.sharding.is_equivalent_to(on, got.ndim)
            if name != "w":
                got, want = jax.random.key_data(got), jax.random.key_data(want)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    leaves = ckptstore.read_manifest_sync(tmp_path / "imported").items["state"].leaves
    assert leaves["rbg/batch"].prng_impl == "rbg" and leaves["rbg/w"].prng_impl is None


@pytest.mark.parametrize("manager", [True, False])
def test_exported_keys_restore_in_orbax_as_typed_keys(tmp_path: Path, manager: bool) -> None:
    trees = sharded_trees()
    ckptstore.save_sync(tmp_path / "ckpt", trees, step=5)
    ckptstore.export_orbax_sync(tmp_path / "ckpt", tmp_path / "out", manager=manager)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, trees)
    if manager:
        with ocp.CheckpointManager(tmp_path / "out") as mgr:
            got = mgr.restore(5, args=ocp.args.StandardRestore(abstract))
    else:
        got = ocp.StandardCheckpointer().restore(tmp_path / "out", abstract)
    for impl, tree in trees.items():
        assert_same_tree(got[impl], tree)
    # And back: the export imports as the keys that were saved.
    ckptstore.import_orbax_sync(tmp_path / "out", tmp_path / "back", as_step=5)
    back = ckptstore.restore_sync(tmp_path / "back")
    for impl, tree in trees.items():
        assert_same_tree(back[impl], tree)


def _records(root: Path) -> Path:
    return root / "3" / "default" / "array_metadatas" / "process_0"


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda d: d["array_metadatas"].append(7), CorruptCheckpointError, "malformed 7"),
        (lambda d: d.update(array_metadatas={}), CorruptCheckpointError, "no array_metadatas"),
        (
            lambda d: d["array_metadatas"][0]["array_metadata"].update(
                ext_metadata={"random_key_impl": "../x"}
            ),
            CorruptCheckpointError,
            "bad PRNG implementation",
        ),
        (
            lambda d: d["array_metadatas"][0]["array_metadata"].update(
                ext_metadata={"random_key_impl": "no_such_impl"}
            ),
            UnsupportedLeafError,
            "'no_such_impl' is unknown",
        ),
        (
            lambda d: d["array_metadatas"][0]["array_metadata"].update(param_name="w"),
            CorruptCheckpointError,
            "'w' is recorded as rbg keys but is a jax float32",
        ),
    ],
)
def test_damaged_key_records_are_typed_errors(
    tmp_path: Path, edit: Any, error: type[Exception], match: str
) -> None:
    orbax_save(tmp_path, {"k": jax.random.key(1, impl="rbg"), "w": jax.numpy.ones(4)})
    doc = json.loads(_records(tmp_path).read_bytes())
    doc["array_metadatas"] = [
        r for r in doc["array_metadatas"] if r["array_metadata"]["param_name"] == "k"
    ]
    edit(doc)
    _records(tmp_path).write_text(json.dumps(doc))
    with pytest.raises(error, match=match):
        ckptstore.restore_sync(tmp_path)
    with pytest.raises(error, match=match):
        ckptstore.import_orbax_sync(tmp_path, tmp_path / "imported")
    _records(tmp_path).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="process_0"):
        ckptstore.restore_sync(tmp_path)


def test_keys_saved_before_orbax_recorded_them_stay_key_data(tmp_path: Path) -> None:
    tree = {"k": jax.random.key(1, impl="rbg")}
    orbax_save(tmp_path, tree)
    _records(tmp_path).unlink()
    got = ckptstore.restore_sync(tmp_path)
    assert got["k"].dtype == np.uint32
    np.testing.assert_array_equal(got["k"], jax.random.key_data(tree["k"]))
