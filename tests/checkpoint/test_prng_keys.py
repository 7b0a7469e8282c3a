"""Typed PRNG keys (``jax.random.key``, every implementation) save and restore bit-exact:
plain and partial saves, the manager's staging, sharded or not, with and without ``like``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.format.manifest import parse_leaf
from tests.checkpoint.helpers import IMPLS, assert_same_keys, keys_tree, mesh


def assert_same_tree(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            assert_same_keys(got[name], value)
        else:
            np.testing.assert_array_equal(got[name], value)


async def test_every_implementation_round_trips(any_backend: Backend) -> None:
    trees = {impl: keys_tree(impl) for impl in IMPLS}
    await ckptstore.save(any_backend, trees, step=1)
    plain = await ckptstore.restore(any_backend)  # no like: typed keys of the saved impl
    shapes = jax.eval_shape(lambda: trees)  # like from ShapeDtypeStructs, key dtypes kept
    from_shapes = await ckptstore.restore(any_backend, like=shapes)
    from_arrays = await ckptstore.restore(any_backend, like=trees)
    for impl, tree in trees.items():
        for restored in (plain, from_shapes, from_arrays):
            assert_same_tree(restored[impl], tree)
    manifest = await ckptstore.read_manifest(any_backend)
    leaves = manifest.items["state"].leaves
    assert leaves["rbg/batch"].prng_impl == "rbg"
    assert leaves["rbg/batch"].shape == (6, 4) and leaves["rbg/batch"].dtype == "uint32"
    assert leaves["threefry2x32/one"].prng_impl == "threefry2x32"
    assert leaves["threefry2x32/w"].prng_impl is None
    assert (await ckptstore.verify(any_backend)).ok


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
async def test_sharded_keys_restore_onto_their_mesh_and_another(tmp_path: Path, impl: str) -> None:
    on = NamedSharding(mesh(), P("x", "y"))
    keys = jax.device_put(jax.random.split(jax.random.key(3, impl=impl), (8, 4)), on)
    assert keys.sharding == on and keys.dtype != np.uint32
    root = str(tmp_path / "ckpt")
    await ckptstore.save(root, {"keys": keys}, step=2)

    same = await ckptstore.restore(root, like={"keys": keys})
    assert same["keys"].sharding.is_equivalent_to(on, 2)
    assert_same_keys(same["keys"], keys)

    other = NamedSharding(mesh(), P("y", None))
    like = {"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=other)}
    moved = await ckptstore.restore(root, like=like)
    assert moved["keys"].sharding.is_equivalent_to(other, 2)
    assert_same_keys(moved["keys"], keys)

    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    like = {"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=one)}
    single = await ckptstore.restore(root, like=like)
    assert single["keys"].devices() == {jax.devices()[5]}
    assert_same_keys(single["keys"], keys)


async def test_keys_of_another_implementation_are_refused_by_name(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    await ckptstore.save(root, {"rng": jax.random.key(0, impl="rbg")}, step=1)
    with pytest.raises(ckptstore.TreeMismatchError, match="rng: threefry2x32 keys requested, rbg"):
        await ckptstore.restore(root, like={"rng": jax.random.key(0)})
    # Asked for as plain data, the key data comes back as it is.
    data = await ckptstore.restore(root, like={"rng": np.zeros(4, np.uint32)})
    np.testing.assert_array_equal(data["rng"], jax.random.key_data(jax.random.key(0, impl="rbg")))


async def test_key_data_saved_by_hand_restores_as_keys(tmp_path: Path) -> None:
    """The former workaround (save `key_data`, rebuild with `wrap_key_data`) keeps reading,
    and a ``like`` of typed keys now gets typed keys from it."""
    root = str(tmp_path / "ckpt")
    key = jax.random.split(jax.random.key(5), 3)
    await ckptstore.save(root, {"rng": jax.random.key_data(key)}, step=1)
    assert (await ckptstore.restore(root))["rng"].dtype == np.uint32
    restored = await ckptstore.restore(root, like={"rng": key})
    assert_same_keys(restored["rng"], key)


async def test_partial_saves_hold_typed_keys(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    sharded = jax.device_put(
        jax.random.split(jax.random.key(9, impl="unsafe_rbg"), 8), NamedSharding(mesh(), P("x"))
    )
    session = await ckptstore.partial_save(root, step=4)
    await session.add({"rng": {"a": jax.random.key(1)}})
    await session.add({"rng": {"b": sharded}, "w": np.ones(3, np.float32)})
    await session.finalize()
    plain = await ckptstore.restore(root)
    assert_same_keys(plain["rng"]["a"], jax.random.key(1))
    assert_same_keys(plain["rng"]["b"], sharded)
    like = {"rng": {"a": jax.random.key(0), "b": sharded}, "w": np.zeros(3, np.float32)}
    restored = await ckptstore.restore(root, like=like)
    assert restored["rng"]["b"].sharding.is_equivalent_to(sharded.sharding, 1)
    assert_same_keys(restored["rng"]["b"], sharded)


async def test_tiers_promote_typed_keys_and_restore_them_from_the_durable_tier(
    tmp_path: Path,
) -> None:
    tiers = ckptstore.Tiered(str(tmp_path / "fast"), str(tmp_path / "durable"))
    keys = jax.random.split(jax.random.key(2, impl="rbg"), 5)
    await ckptstore.save(tiers, {"rng": keys}, step=1)
    await ckptstore.promote(tiers)
    shutil.rmtree(tmp_path / "fast")  # a restart on new machines: only the durable copy
    assert_same_keys((await ckptstore.restore(tiers))["rng"], keys)
    assert_same_keys((await ckptstore.restore(tiers, like={"rng": keys}))["rng"], keys)


@pytest.mark.parametrize("staging", ["host", "view"])
def test_the_manager_stages_and_saves_typed_keys(tmp_path: Path, staging: str) -> None:
    """Staging copied (or viewed) the keys' data, so the keys may be donated or deleted as
    soon as `save` returns."""
    root = str(tmp_path / "run")
    on = NamedSharding(mesh(), P("x", "y"))
    options = ckptstore.ManagerOptions(handle_sigterm=False, staging=staging)
    with ckptstore.CheckpointManager(root, options=options) as mgr:
        for step in (1, 2):
            state = {
                "rng": jax.random.key(step),
                "sharded": jax.device_put(
                    jax.random.split(jax.random.key(step, impl="rbg"), (8, 4)), on
                ),
                "w": jnp.arange(8.0) * step,
            }
            expected = {k: jax.random.key_data(v) if k != "w" else v for k, v in state.items()}
            expected = jax.tree.map(np.array, expected)
            like = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
            )
            handle = mgr.save(step, state)
            assert handle is not None
            for leaf in state.values():
                leaf.delete()
            handle.wait()
            for restored in (mgr.restore(step), mgr.restore(step, like=like)):
                for name in ("rng", "sharded"):
                    got = restored[name]
                    assert got.dtype == like[name].dtype
                    np.testing.assert_array_equal(jax.random.key_data(got), expected[name])
                np.testing.assert_array_equal(restored["w"], expected["w"])
            assert mgr.restore(step, like=like)["sharded"].sharding.is_equivalent_to(on, 2)
            assert ckptstore.verify_sync(root, step=step).ok


def test_leaf_records_with_and_without_an_implementation_parse() -> None:
    record = {
        "shape": [3, 2],
        "dtype": "uint32",
        "chunk_shape": [3, 2],
        "kind": "jax",
        "python_type": None,
        "sharding": None,
        "nbytes": 24,
    }
    assert parse_leaf("k", record).prng_impl is None  # as written before keys were saved
    info = parse_leaf("k", {**record, "prng_impl": "threefry2x32"})
    assert info.prng_impl == "threefry2x32"
    assert parse_leaf("k", json.loads(json.dumps(info.to_json()))) == info
    assert "prng_impl" not in parse_leaf("k", record).to_json()  # other leaves unchanged
    for bad in (3, "", "../x", "a" * 65):
        with pytest.raises(ValueError, match="bad PRNG implementation"):
            parse_leaf("k", {**record, "prng_impl": bad})
    with pytest.raises(ValueError, match="must be a jax array"):
        parse_leaf("k", {**record, "kind": "numpy", "prng_impl": "rbg"})


async def test_a_stored_implementation_this_jax_lacks_is_refused_typed(tmp_path: Path) -> None:
    from ckptstore.backends.local import LocalBackend
    from ckptstore.format import layout

    root = tmp_path / "ckpt"
    await ckptstore.save(str(root), {"rng": jax.random.key(0)}, step=1)
    # Rewrite the manifest as a jax with another implementation would have written it;
    # the commit marker's digest then no longer matches, so the whole step is refused...
    manifest = await ckptstore.read_manifest(str(root))
    path = root / layout.AttemptDir(1, manifest.attempt).manifest
    doc = json.loads(path.read_bytes())
    doc["items"]["state"]["leaves"]["rng"]["prng_impl"] = "future_rng"
    path.write_bytes(json.dumps(doc).encode())
    with pytest.raises(ckptstore.CorruptCheckpointError):
        await ckptstore.restore(str(root))
    # ...and read by the restore layer itself (as a verified manifest), it is typed too.
    from ckptstore.checkpoint.restore import RestoreOptions, restore_manifest
    from ckptstore.format.manifest import Manifest

    forged = Manifest.from_bytes(json.dumps(doc).encode(), where="test")
    async with LocalBackend(root) as backend:
        with pytest.raises(ckptstore.CkptStoreError, match="'future_rng' is unknown"):
            await restore_manifest(backend, forged, None, RestoreOptions())


# ---- a Flax NNX model: typed keys in nnx.Rngs and Dropout, an nnx.Optimizer ----


def test_an_nnx_model_with_dropout_resumes_bit_exact_through_the_manager(tmp_path: Path) -> None:
    """Train with dropout, save model + optimizer through the manager, keep training; a
    fresh model restored from the step (no key code) trains on to the very same numbers."""
    nnx = pytest.importorskip("flax.nnx")
    import optax

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.lin1 = nnx.Linear(8, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.lin2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.lin2(self.drop(jax.nn.relu(self.lin1(x))))

    def make() -> tuple[Any, Any]:
        model = Model(nnx.Rngs(params=0, dropout=1))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: Any, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: Any) -> jax.Array:
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jnp.sum(x, axis=1, keepdims=True)

    def run(model: Any, optimizer: Any, steps: range) -> list[float]:
        return [float(train_step(model, optimizer, x, y)) for _ in steps]

    model, optimizer = make()
    run(model, optimizer, range(3))
    state = nnx.state((model, optimizer))
    assert any(
        jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) for leaf in jax.tree.leaves(state)
    ), "the state holds typed keys (what this test is about)"
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    root = str(tmp_path / "run")
    with ckptstore.CheckpointManager(root, options=options) as mgr:
        handle = mgr.save(3, state)
        assert handle is not None
        handle.wait()
    expected = run(model, optimizer, range(3, 6))  # the run that was not interrupted

    fresh_model, fresh_optimizer = nnx.eval_shape(make)  # nothing computed, no keys drawn
    with ckptstore.CheckpointManager(root, options=options) as mgr:
        assert mgr.latest_step() == 3
        restored = mgr.restore(like=nnx.state((fresh_model, fresh_optimizer)))
    nnx.update((fresh_model, fresh_optimizer), restored)
    assert run(fresh_model, fresh_optimizer, range(3, 6)) == expected
    for a, b in zip(
        jax.tree.leaves(nnx.state((model, optimizer))),
        jax.tree.leaves(nnx.state((fresh_model, fresh_optimizer))),
        strict=True,
    ):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert a.dtype == b.dtype
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
