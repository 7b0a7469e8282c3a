"""Checkpoint save / restore on every backend: leaf kinds, dtypes, strictness, commit rules."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.format import layout

Pair = collections.namedtuple("Pair", "first second")

DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e4m3b11fnuz,
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint32,
    np.uint64,
    np.complex64,
    np.complex128,
]


def sample_tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "dense": {"kernel": rng.standard_normal((16, 8), dtype=np.float32), "bias": None},
            "embed": jnp.asarray(rng.standard_normal((32, 4)), dtype=jnp.bfloat16),
        },
        "dtypes": {
            np.dtype(d).name: (rng.standard_normal(6) * 3).astype(d)
            if np.dtype(d).kind != "c"
            else (rng.standard_normal(6) + 1j).astype(d)
            for d in DTYPES
        },
        "opt": [np.int32(7), 3, 2.5, True, 1 + 2j, (np.zeros((0, 3)), np.float16(1.5))],
        "pair": Pair(np.arange(5), {"inner": np.array(4.0)}),
        "odd keys": {"a/b": np.ones(2), "..": np.zeros(1), "": np.arange(2)},
        "int keys": {3: np.arange(2), 10: np.ones(1)},
        "empty": {},
    }


def assert_same(a: Any, b: Any) -> None:
    """Same structure (by description: a rebuilt namedtuple is a new class), same bits."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert str(ta) == str(tb)
    for x, y in zip(la, lb, strict=True):
        if isinstance(y, (bool, int, float, complex)):
            assert type(x) is type(y), (x, y)
        xa, ya = np.asarray(x), np.asarray(y)
        assert xa.dtype == ya.dtype and xa.shape == ya.shape
        assert xa.tobytes() == ya.tobytes()


async def test_roundtrip_every_leaf_kind(any_backend: Backend) -> None:
    tree = sample_tree()
    result = await ckptstore.save(any_backend, tree, step=10)
    assert result.step == 10 and result.bytes > 0
    assert await ckptstore.list_steps(any_backend) == [10]
    assert_same(await ckptstore.restore(any_backend), tree)
    restored = await ckptstore.restore(any_backend, like=tree)
    assert type(restored["pair"]) is Pair
    assert_same(restored, tree)


async def test_python_scalars_come_back_as_python(any_backend: Backend) -> None:
    await ckptstore.save(any_backend, {"i": 3, "f": 0.5, "b": False, "c": 2j}, step=0)
    out = await ckptstore.restore(any_backend, step=0)
    assert out == {"i": 3, "f": 0.5, "b": False, "c": 2j}
    assert [type(v) for v in out.values()] == [int, float, bool, complex]


async def test_latest_and_specific_steps(any_backend: Backend) -> None:
    for step in (1, 5, 3):
        await ckptstore.save(any_backend, {"x": np.full(3, step)}, step=step)
    assert await ckptstore.list_steps(any_backend) == [1, 3, 5]
    assert (await ckptstore.restore(any_backend))["x"][0] == 5
    assert (await ckptstore.restore(any_backend, step=3))["x"][0] == 3
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        await ckptstore.restore(any_backend, step=4)


async def test_saving_a_committed_step_is_refused(any_backend: Backend) -> None:
    first = await ckptstore.save(any_backend, {"x": np.arange(3)}, step=2)
    with pytest.raises(ckptstore.AlreadyExistsError):
        await ckptstore.save(any_backend, {"x": np.arange(4), "y": np.ones(9)}, step=2)
    np.testing.assert_array_equal((await ckptstore.restore(any_backend))["x"], np.arange(3))
    # The refusal came while the writes ran: the attempt they wrote is discarded at once.
    names = {info.key.split("/")[1] async for info in any_backend.list("2")}
    assert {n for n in names if n.startswith("attempt")} == {first.attempt}


async def test_uncommitted_steps_are_invisible_and_replaced(any_backend: Backend) -> None:
    await ckptstore.save(any_backend, {"x": np.arange(3)}, step=1)
    # What a crashed writer leaves: data and even a manifest, but no marker.
    crashed = layout.AttemptDir(2, layout.new_attempt())
    await any_backend.write(f"{crashed.process_store('state', 0)}/junk", b"partial")
    await any_backend.write(crashed.manifest, b"{}")
    assert await ckptstore.list_steps(any_backend) == [1]
    np.testing.assert_array_equal((await ckptstore.restore(any_backend))["x"], np.arange(3))
    await ckptstore.save(any_backend, {"x": np.arange(5)}, step=2)
    assert await any_backend.exists(crashed.manifest)  # another attempt's files: untouched
    np.testing.assert_array_equal((await ckptstore.restore(any_backend))["x"], np.arange(5))
    removal = await ckptstore.gc(any_backend, older_than=0)
    assert removal.entries == [crashed.root] and removal.objects == 2
    assert not await any_backend.exists(crashed.manifest)
    np.testing.assert_array_equal((await ckptstore.restore(any_backend))["x"], np.arange(5))


async def test_empty_target_has_no_checkpoint(any_backend: Backend) -> None:
    assert await ckptstore.list_steps(any_backend) == []
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        await ckptstore.restore(any_backend)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: dict[str, Any]
    step: Any
    note: str = dataclasses.field(metadata={"static": True}, default="static")


async def test_registered_pytree_nodes(any_backend: Backend) -> None:
    state = TrainState(params={"w": np.arange(6.0).reshape(2, 3)}, step=np.int32(3))
    await ckptstore.save(any_backend, state, step=1)
    exact = await ckptstore.restore(any_backend, like=state)
    assert isinstance(exact, TrainState) and exact.note == "static"
    np.testing.assert_array_equal(exact.params["w"], state.params["w"])
    assert exact.step == 3
    # Without `like`, a node type ckptstore cannot import comes back as a dict of its children.
    plain = await ckptstore.restore(any_backend)
    assert set(plain) == {"params", "step"}
    np.testing.assert_array_equal(plain["params"]["w"], state.params["w"])


async def test_unsupported_leaves_are_refused_before_writing(any_backend: Backend) -> None:
    with pytest.raises(ckptstore.CkptStoreError, match="leaf 'name' is a str"):
        await ckptstore.save(any_backend, {"name": "text", "x": np.zeros(2)}, step=1)
    with pytest.raises(ckptstore.CkptStoreError, match="does not fit in int64"):
        # beside an array: alone, Python ints are a JSON item, which holds any int
        await ckptstore.save(any_backend, {"big": 2**70, "x": np.zeros(2)}, step=1)
    assert [info async for info in any_backend.list()] == []


def test_a_missing_step_or_root_says_what_is_there(tmp_path: Path) -> None:
    """A step that is not committed names the steps that are (the last ten); a mistyped
    local root says there is no such directory instead of "no committed checkpoint"."""
    root = str(tmp_path / "run")
    for step in range(12):
        ckptstore.save_sync(root, {"w": np.arange(3.0)}, step=step)
    with pytest.raises(ckptstore.CheckpointNotFoundError) as missing:
        ckptstore.restore_sync(root, 40)
    assert "step 40 is not committed; committed steps: 2, 3, 4" in str(missing.value)
    assert "11 (the last 10 of 12)" in str(missing.value)
    typo = str(tmp_path / "rnu")
    with pytest.raises(ckptstore.CheckpointNotFoundError, match=f"no such directory {typo}"):
        ckptstore.restore_sync(typo)
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="no step is committed there"):
        ckptstore.restore_sync(str(tmp_path))
