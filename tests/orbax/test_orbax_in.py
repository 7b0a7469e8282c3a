"""Orbax in: checkpoints written by real Orbax 0.12.8 restored by ckptstore, unconverted."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.errors import UnsupportedLeafError
from tests.conftest import make_backend
from tests.orbax.conftest import assert_bit_exact, mesh, orbax_save, saved_form, sharded


def every_kind() -> dict[str, Any]:
    """Every leaf kind and dtype family Orbax stores, nested in dicts, lists and tuples."""
    w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 7
    return {
        "params": {
            "w": sharded(w, P("x", "y")),
            "b": jnp.arange(16, dtype=jnp.bfloat16) / 3,
            "f8": np.linspace(-2, 2, 12).astype(ml_dtypes.float8_e4m3fn),
            "mask": np.array([True, False, True]),
        },
        "layers": [
            {"k": np.arange(6, dtype=np.int32).reshape(2, 3)},
            {"k": np.arange(6, 12, dtype=np.int32).reshape(2, 3)},
        ],
        "pair": (np.zeros((2, 2), np.float64), np.uint8(200)),
        "step": 12,
        "lr": 0.25,
        "done": True,
        "none": None,
        "empty": {},
        "nothing": [],
    }


LAYOUTS = ["zarr2-ocdbt", "zarr3-ocdbt", "zarr2-plain", "zarr3-plain"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_standard_checkpoint_restores_bit_exact(tmp_path: Path, layout: str) -> None:
    tree = every_kind()
    orbax_save(tmp_path / "ckpt", tree, layout)
    meta = json.loads((tmp_path / "ckpt" / "_METADATA").read_text())
    assert (meta["use_zarr3"], meta["use_ocdbt"]) == (layout[4] == "3", "ocdbt" in layout)
    assert ckptstore.list_steps_sync(tmp_path / "ckpt") == []  # one checkpoint, no steps
    out = ckptstore.restore_sync(tmp_path / "ckpt")
    want = saved_form(tree)
    if layout.startswith("zarr3"):  # PyTreeCheckpointer records numpy scalars as "scalar":
        want["pair"][1] = 200  # Orbax itself restores those as Python numbers
    assert_bit_exact(out, want)


@pytest.mark.parametrize("layout", ["zarr2-ocdbt", "zarr3-plain"])
def test_restore_onto_another_mesh(tmp_path: Path, layout: str) -> None:
    tree = every_kind()
    orbax_save(tmp_path / "ckpt", tree, layout)
    m = mesh((2, 4), ("a", "b"))

    def on(spec: P, x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            np.shape(x), np.asarray(x).dtype, sharding=NamedSharding(m, spec)
        )

    # The 32-bit and narrower leaves (jax without x64 would narrow the others).
    like = {
        "params": {
            "w": on(P("b", "a"), tree["params"]["w"]),
            "b": on(P("b"), tree["params"]["b"]),
            "f8": on(P("b"), tree["params"]["f8"]),
            "mask": on(P(), tree["params"]["mask"]),
        },
        "layers": [{"k": on(P("a"), layer["k"])} for layer in tree["layers"]],
    }
    out = ckptstore.restore_sync(tmp_path / "ckpt", like=like, partial=True)
    got = jax.tree_util.tree_leaves_with_path(out)
    assert len(got) == 6
    for (path, arr), spec in zip(got, jax.tree_util.tree_leaves(like), strict=True):
        want = np.asarray(jax.tree_util.tree_leaves(every_kind_at(tree, path))[0])
        assert isinstance(arr, jax.Array) and arr.sharding == spec.sharding, path
        assert arr.dtype == want.dtype and np.asarray(arr).tobytes() == want.tobytes(), path
    assert out["params"]["w"].addressable_shards[0].data.shape == (16, 8)


def every_kind_at(tree: Any, path: Any) -> Any:
    for key in path:
        tree = tree[key.key if isinstance(key, jax.tree_util.DictKey) else key.idx]
    return tree


def test_strict_partial_and_cast(tmp_path: Path) -> None:
    tree = {"a": np.arange(8, dtype=np.float32), "b": {"c": np.ones((2, 2), np.int32)}, "s": 3}
    orbax_save(tmp_path / "ckpt", tree)
    like: dict[str, Any] = {"a": jax.ShapeDtypeStruct((8,), np.float32)}
    with pytest.raises(ckptstore.TreeMismatchError) as info:
        ckptstore.restore_sync(tmp_path / "ckpt", like=like)
    assert sorted(info.value.problems) == [
        "b/c: stored but not requested (pass partial=True)",
        "s: stored but not requested (pass partial=True)",
    ]
    out = ckptstore.restore_sync(tmp_path / "ckpt", like=like, partial=True)
    assert out["a"].tobytes() == tree["a"].tobytes()
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="without items"):
        ckptstore.restore_sync(tmp_path / "ckpt", item="params")

    wrong = {
        "a": jax.ShapeDtypeStruct((8,), np.float16),
        "b": {"c": jax.ShapeDtypeStruct((2, 3), np.int32)},
        "s": 0,
        "x": jax.ShapeDtypeStruct((1,), np.float32),
    }
    with pytest.raises(ckptstore.TreeMismatchError) as info:
        ckptstore.restore_sync(tmp_path / "ckpt", like=wrong)
    assert sorted(info.value.problems) == [
        "a: dtype float16 requested, float32 stored (pass cast=True)",
        "b/c: shape [2, 3] requested, [2, 2] stored",
        "x: not in the checkpoint",
    ]
    cast = {"a": jax.ShapeDtypeStruct((8,), np.float16), "b": {"c": np.zeros((2, 2), np.int32)}}
    out = ckptstore.restore_sync(tmp_path / "ckpt", like={**cast, "s": 0}, cast=True)
    assert out["a"].dtype == np.float16 and out["a"].tolist() == list(range(8))
    assert out["s"] == 3 and type(out["s"]) is int


def test_checkpoint_manager_root_lists_finalized_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    trees = {s: {"w": np.full((4, 4), s, np.float32), "step": s} for s in (1, 2)}
    with ocp.CheckpointManager(root) as manager:
        for s, tree in trees.items():
            manager.save(s, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    # What Orbax leaves while it writes step 3, and a stray numbered folder, are not steps.
    shutil.copytree(root / "2", root / "3.orbax-checkpoint-tmp-1796000000")
    (root / "4").mkdir()
    (root / "4" / "default").mkdir()
    assert ckptstore.list_steps_sync(root) == [1, 2]
    latest = ckptstore.restore_sync(root)
    assert_bit_exact(latest, saved_form(trees[2]))
    first = ckptstore.restore_sync(root, step=1)
    assert_bit_exact(first, saved_form(trees[1]))
    for step in (3, 4):
        with pytest.raises(ckptstore.CheckpointNotFoundError, match=f"step {step}"):
            ckptstore.restore_sync(root, step=step)


def test_checkpoint_manager_named_items(tmp_path: Path) -> None:
    root = tmp_path / "run"
    params = {"w": np.arange(6.0).reshape(2, 3)}
    opt = {"mu": [np.ones(3, np.float32)], "count": 7}
    with ocp.CheckpointManager(root) as manager:
        manager.save(
            5,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt=ocp.args.StandardSave(opt),
                meta=ocp.args.JsonSave({"note": "not a tree"}),
            ),
        )
        manager.wait_until_finished()
    assert ckptstore.list_steps_sync(root) == [5]
    assert_bit_exact(ckptstore.restore_sync(root, item="opt"), saved_form(opt))
    assert_bit_exact(ckptstore.restore_sync(root, step=5, item="params"), saved_form(params))
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="'meta', 'opt', 'params'"):
        ckptstore.restore_sync(root, item="state")  # two tree items: no default
    assert ckptstore.restore_sync(root, item="meta") == {"note": "not a tree"}  # a JSON item


def test_zarr3_manager_with_sharded_arrays(tmp_path: Path) -> None:
    root = tmp_path / "run"
    tree = {"w": sharded(np.arange(32.0, dtype=np.float32).reshape(8, 4), P("x"))}
    with ocp.CheckpointManager(
        root, item_handlers=ocp.PyTreeCheckpointHandler(use_zarr3=True)
    ) as manager:
        manager.save(7, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()
    target = NamedSharding(mesh((2, 4)), P(None, "y"))
    like = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=target)}
    out = ckptstore.restore_sync(root, like=like)
    assert out["w"].sharding == like["w"].sharding
    assert np.asarray(out["w"]).tobytes() == np.asarray(tree["w"]).tobytes()


def test_ckptstore_step_wins_and_empty_root_still_says_so(tmp_path: Path) -> None:
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="no committed checkpoint"):
        ckptstore.restore_sync(tmp_path)
    ckptstore.save_sync(tmp_path, {"native": np.ones(2)}, step=1)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(2, args=ocp.args.StandardSave({"orbax": np.zeros(2)}))
        manager.wait_until_finished()
    # A ckptstore root lists and restores its committed steps only.
    assert ckptstore.list_steps_sync(tmp_path) == [1]
    assert list(ckptstore.restore_sync(tmp_path)) == ["native"]
    assert list(ckptstore.restore_sync(tmp_path, step=2)) == ["orbax"]


# ---- damage ----


def test_missing_chunk_is_corrupt_not_zeros(tmp_path: Path) -> None:
    tree = {"w": np.arange(16.0).reshape(4, 4), "v": np.arange(3)}
    orbax_save(tmp_path / "plain", tree, "zarr2-plain")
    (tmp_path / "plain" / "w" / "0.0").unlink()
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        ckptstore.restore_sync(tmp_path / "plain")
    assert info.value.leaf == "w"
    # Asking only for the intact leaf still works.
    like = {"v": np.zeros(3, np.int64)}
    assert ckptstore.restore_sync(tmp_path / "plain", like=like, partial=True)["v"].tolist() == [
        0,
        1,
        2,
    ]


def test_lost_ocdbt_data_file_is_corrupt(tmp_path: Path) -> None:
    # Incompressible and large, so OCDBT keeps it in a data file rather than inline.
    data = np.random.default_rng(0).random(1 << 17, dtype=np.float32)
    orbax_save(tmp_path / "ckpt", {"w": data})
    files = sorted((tmp_path / "ckpt" / "ocdbt.process_0" / "d").iterdir())
    biggest = max(files, key=lambda f: f.stat().st_size)
    assert biggest.stat().st_size > data.nbytes // 2
    biggest.unlink()
    with pytest.raises(ckptstore.CorruptCheckpointError):
        ckptstore.restore_sync(tmp_path / "ckpt")


def _edit_metadata(path: Path, edit: Any) -> None:
    meta = json.loads((path / "_METADATA").read_text())
    text = edit(meta)
    (path / "_METADATA").write_text(text if isinstance(text, str) else json.dumps(meta))


def _first(meta: dict[str, Any]) -> dict[str, Any]:
    return next(iter(meta["tree_metadata"].values()))  # type: ignore[no-any-return]


def _keys(*names: str) -> list[dict[str, Any]]:
    return [{"key": n, "key_type": 2} for n in names]


EDITS = {
    "not JSON": (lambda m: "{not json", "unreadable Orbax tree metadata"),
    "NaN": (lambda m: json.dumps(m).replace('"use_zarr3": false', '"use_zarr3": NaN'), "NaN"),
    "duplicate key": (
        lambda m: json.dumps(m).replace('"use_ocdbt": true', '"use_ocdbt": true, "use_ocdbt": 1'),
        "duplicate key 'use_ocdbt'",
    ),
    "no tree": (lambda m: m.pop("tree_metadata"), "'tree_metadata' is missing"),
    "key type": (lambda m: _first(m)["key_metadata"][0].update(key_type=3), "bad key"),
    "flag type": (lambda m: m.update(use_ocdbt="yes"), "'use_ocdbt' is 'yes'"),
    "value type": (
        lambda m: _first(m)["value_metadata"].update(value_type="pickle"),
        "unknown value type 'pickle'",
    ),
    "index gap": (
        lambda m: m["tree_metadata"]["('l', '1')"]["key_metadata"][1].update(key="2"),
        "a sequence has indices [0, 2]",
    ),
    "mixed keys": (
        lambda m: m["tree_metadata"]["('l', '1')"]["key_metadata"][1].update(key_type=2),
        "one container holds both indices and keys",
    ),
    "below a value": (
        lambda m: m["tree_metadata"].update(
            {"('w', 'x')": {**m["tree_metadata"]["('w',)"], "key_metadata": _keys("w", "x")}}
        ),
        "'w/x' lies below a stored value",
    ),
    "unknown leaf": (
        lambda m: m["tree_metadata"].update(
            {
                "('ghost',)": {
                    **m["tree_metadata"]["('w',)"],
                    "key_metadata": [{"key": "ghost", "key_type": 2}],
                }
            }
        ),
        "cannot open Orbax array 'ghost'",
    ),
}


@pytest.mark.parametrize("damage", list(EDITS))
def test_hand_edited_metadata_is_a_typed_error(tmp_path: Path, damage: str) -> None:
    orbax_save(tmp_path / "ckpt", {"w": np.arange(4.0), "l": [np.ones(2), np.zeros(2)]})
    edit, message = EDITS[damage]
    _edit_metadata(tmp_path / "ckpt", edit)
    with pytest.raises(ckptstore.CorruptCheckpointError, match=message.replace("[", r"\[")):
        ckptstore.restore_sync(tmp_path / "ckpt")


def test_string_leaves_are_refused_by_name(tmp_path: Path) -> None:
    ocp.PyTreeCheckpointer().save(tmp_path / "ckpt", {"w": np.arange(4.0), "name": "run-7"})
    with pytest.raises(UnsupportedLeafError, match=r"name \(string\)"):
        ckptstore.restore_sync(tmp_path / "ckpt")


# ---- object storage ----


async def upload(local: Path, backend: ckptstore.Backend) -> None:
    """Copy an Orbax checkpoint written locally (Orbax cannot write s3://) object for object."""
    files = [p for p in local.rglob("*") if p.is_file()]
    await asyncio.gather(
        *(backend.write(p.relative_to(local).as_posix(), p.read_bytes()) for p in files)
    )


@pytest.mark.parametrize("kind", ["s3", "gcs", "memory"])
async def test_orbax_checkpoint_on_object_storage(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    root = tmp_path / "run"
    trees = {s: {"w": sharded(np.full((8, 4), s, np.float32), P("x")), "n": s} for s in (1, 2)}

    def save() -> None:
        with ocp.CheckpointManager(root) as manager:
            for s, tree in trees.items():
                manager.save(s, args=ocp.args.StandardSave(tree))
            manager.wait_until_finished()

    await asyncio.to_thread(save)
    async with await make_backend(kind, request, tmp_path) as backend:
        await upload(root, backend)
        # A step Orbax is still writing in place: no commit_success.txt yet.
        await backend.write("3/_CHECKPOINT_METADATA", b"{}")
        assert await ckptstore.list_steps(backend) == [1, 2]
        like = {
            "w": jax.ShapeDtypeStruct(
                (8, 4), np.float32, sharding=NamedSharding(mesh((2, 4)), P(None, "y"))
            ),
            "n": 0,
        }
        out = await ckptstore.restore(backend, step=1, like=like)
        assert out["n"] == 1 and out["w"].sharding == like["w"].sharding
        assert np.asarray(out["w"]).tobytes() == np.asarray(trees[1]["w"]).tobytes()
        latest = await ckptstore.restore(backend)
        assert_bit_exact(latest, saved_form(trees[2]))
        with pytest.raises(ckptstore.CheckpointNotFoundError):
            await ckptstore.restore(backend, step=3)
