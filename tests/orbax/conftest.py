"""What the Orbax tests share: real Orbax 0.12.8 saving trees on meshes of the 8 CPU
devices, and bit-exact comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh(shape: tuple[int, int], names: tuple[str, str] = ("x", "y")) -> Mesh:
    return Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), names)


@pytest.fixture(scope="module", autouse=True)
def eight_devices() -> None:
    if len(jax.devices()) < 8:
        pytest.fail(f"need 8 CPU devices (XLA_FLAGS), have {len(jax.devices())}")


def sharded(data: np.ndarray[Any, Any], spec: P, shape: tuple[int, int] = (4, 2)) -> jax.Array:
    return jax.device_put(data, NamedSharding(mesh(shape), spec))


def saved_form(tree: Any) -> Any:
    """What ckptstore restores with like=None: numpy arrays, Python scalars, tuples as lists."""
    if isinstance(tree, dict):
        return {k: saved_form(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [saved_form(v) for v in tree]
    if tree is None or type(tree) in (int, float, bool):
        return tree
    return np.asarray(tree)


def assert_bit_exact(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == sorted(want), where  # Orbax stores dict keys sorted
        for k in want:
            assert_bit_exact(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bit_exact(g, w, f"{where}/{i}")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.tobytes() == want.tobytes(), where
    else:
        assert got == want, where


def orbax_save(path: Path, tree: Any, layout: str = "zarr2-ocdbt") -> None:
    """Save ``tree`` with Orbax the way ``layout`` names (format, OCDBT or plain)."""
    zarr3, ocdbt = layout.startswith("zarr3"), layout.endswith("-ocdbt")
    if zarr3:
        ocp.PyTreeCheckpointer(use_zarr3=True, use_ocdbt=ocdbt).save(path, tree)
        return
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=ocdbt)
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    checkpointer.close()
