"""Hostile trees are refused whole, typed, before anything is written.

Dicts mixing key kinds (JAX's flatten fails on them with an untyped ValueError), keys that
are no str or int, trees nested deeper than a checkpoint's structure may be (200 levels:
before this check, a save wrote every byte and failed at commit), deeper than Python's
stack, or containing themselves. And one that is fine but unusual: big-endian arrays
restore with exact values in native byte order (docs/architecture.md says so).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import TreeError
from ckptstore.format.tree import MAX_DEPTH
from ckptstore.lifecycle.staging import Stager


def nested(depth: int, leaf: Any) -> Any:
    """``leaf`` below ``depth`` containers (dicts and lists by turns)."""
    for level in range(depth):
        leaf = {"a": leaf} if level % 2 else [leaf]
    return leaf


def _cycle() -> Any:
    tree: list[Any] = [np.ones(1)]
    tree.append({"again": tree})
    return tree


#: id -> (tree, text the TreeError must carry).
TREES: dict[str, tuple[Any, str]] = {
    "int and str keys alike": ({1: np.ones(1), "1": np.zeros(1)}, "mixes int and str keys"),
    "int and str keys": ({1: np.ones(1), "b": np.zeros(1)}, "mixes int and str keys"),
    "mixed keys nested": ({"a": {"b": {2: np.ones(1), "x": 1.0}}}, "dict at 'a/b' mixes"),
    "mixed keys in a list": ([np.ones(1), {0: 1.0, "0": 2.0}], "dict at '1' mixes"),
    "tuple key": ({(1, 2): np.ones(1)}, "must be str or int"),
    "None key": ({None: np.ones(1)}, "must be str or int"),
    "float key": ({2.5: np.ones(1)}, "must be str or int"),
    "bool key": ({True: np.ones(1)}, "must be str or int"),
    "one level too deep": (nested(MAX_DEPTH + 1, np.arange(3.0)), "deeper than 200 levels"),
    "300 levels": (nested(300, np.arange(3.0)), "deeper than 200 levels"),
    "300 levels, no leaf": (nested(300, None), "deeper than 200 levels"),
    "300 levels beside a leaf": (
        {"w": np.ones(2), "deep": nested(300, {})},
        "deeper than 200 levels",
    ),
    "deeper than the stack": (nested(sys.getrecursionlimit() * 5, 1.0), "deeper than 200"),
    "contains itself": (_cycle(), "deeper than 200 levels"),
}

#: Cases whose too-deep part holds no leaf: `flatten` (and so staging) passes them, and
#: `describe`, which every save runs before writing, refuses them.
LEAFLESS = {"300 levels, no leaf", "300 levels beside a leaf"}


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("case", list(TREES))
def test_a_hostile_tree_is_refused_before_anything_is_written(case: str, tmp_path: Path) -> None:
    tree, match = TREES[case]
    root = tmp_path / "ckpt"
    ckptstore.save_sync(str(root), {"good": np.arange(4)}, step=1)
    before = files(root)
    with pytest.raises(TreeError, match=match):
        ckptstore.save_sync(str(root), tree, step=2)
    assert files(root) == before, "the refused save wrote something"

    async def partial() -> None:
        session = await ckptstore.partial_save(str(root), step=3)
        try:
            with pytest.raises(TreeError, match=match):
                await session.add(tree)
        finally:
            await session.abandon()

    asyncio.run(partial())
    if case in LEAFLESS:
        return  # staging copies leaves only; the manager's save then refuses it (describe)
    stager = Stager()
    try:
        with pytest.raises(TreeError, match=match):
            stager.stage(tree)  # what CheckpointManager.save does first
    finally:
        stager.close()
    assert ckptstore.list_steps_sync(str(root)) == [1]


def test_a_tree_at_the_depth_limit_saves_and_restores(tmp_path: Path) -> None:
    """200 levels (the leaf on the 200th): saved, committed, restored exactly, verified."""
    tree = {"deep": nested(MAX_DEPTH - 1, np.arange(5, dtype=np.int16)), "n": None}
    root = str(tmp_path / "ckpt")
    ckptstore.save_sync(root, tree, step=1)
    restored = ckptstore.restore_sync(root, step=1)
    node = restored["deep"]
    for _ in range(MAX_DEPTH - 1):
        node = node["a"] if isinstance(node, dict) else node[0]
    assert node.dtype == np.int16 and node.tolist() == [0, 1, 2, 3, 4]
    assert restored["n"] is None
    assert ckptstore.verify_sync(root, step=1).ok


BIG_ENDIAN = {
    "i4": np.arange(-3, 3, dtype=">i4"),
    "u2": np.array([1, 256, 65535], dtype=">u2"),
    "f8": np.array([0.1, -2.5, np.inf, 1e-300], dtype=">f8"),
    "c8": np.array([1 + 2j, -3.5j], dtype=">c8"),
    "scalar": np.array(7, dtype=">i8"),
}


@pytest.mark.parametrize("like", [False, True])
def test_big_endian_arrays_restore_exact_values_in_native_byte_order(
    like: bool, tmp_path: Path
) -> None:
    """Values are exact; the byte order is the machine's own, with or without ``like=``
    (documented in docs/architecture.md, "Trees")."""
    root = str(tmp_path / "ckpt")
    ckptstore.save_sync(root, BIG_ENDIAN, step=1)
    restored = ckptstore.restore_sync(root, step=1, **({"like": BIG_ENDIAN} if like else {}))
    for name, saved in BIG_ENDIAN.items():
        out = np.asarray(restored[name])
        assert out.dtype == saved.dtype.newbyteorder("="), name
        assert out.dtype.isnative and out.shape == saved.shape, name
        np.testing.assert_array_equal(out, saved)
        assert out.tobytes() == saved.astype(saved.dtype.newbyteorder("=")).tobytes(), name
