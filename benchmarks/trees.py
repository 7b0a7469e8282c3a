"""The trees the save/restore benchmark measures, so no floor holds on one tree only.

Each builder takes a scale (1.0: the sizes below; ``--quick`` uses 1/16) and a
seed, and returns the tree (jax arrays on 8 CPU devices, random float32 data)
and the abstract tree a restore asks for (its `jax.ShapeDtypeStruct` leaves
carry the shardings to restore onto).

- ``a`` (1 GiB): 4 large leaves sharded over a (4, 2) mesh plus 300 small
  replicated leaves of 4-64 KiB (biases, norms); the benchmark's original tree.
- ``b`` (434 MiB): 4 leaves of 96 MiB sharded over (4, 2) plus 200 replicated
  256 KiB leaves: per-leaf cost next to big sequential writes.
- ``c`` (1.15 GiB): 5,000 leaves of 16 KiB to 1 MiB (log-uniform), replicated:
  an optimizer state of many small tensors.
- ``d`` (1 GiB): 2 huge leaves saved sharded over (4, 2), restored onto a
  (2, 4) mesh: each restored slice takes half of each of two saved chunks
  (resharding on restore).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ckptstore.testing.arrays import random_array

MiB = 1 << 20
Built = tuple[dict[str, Any], dict[str, Any]]


def _mesh(shape: tuple[int, int], names: tuple[str, str] = ("data", "model")) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


_ABSTRACT_ONLY = [False]  # set by `abstract`: leaves become ShapeDtypeStructs, no data


def _fill(shape: tuple[int, ...], sharding: NamedSharding, seed: int, salt: int) -> Any:
    if _ABSTRACT_ONLY[0]:
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
    return random_array(shape, sharding, seed, salt)


def abstract_of(tree: Any) -> Any:
    """Restore onto the shardings the tree was saved with."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
    )


def _large_and_small(total: int, small: list[int], seed: int, cols: int) -> dict[str, Any]:
    mesh = _mesh((4, 2))
    sharded = NamedSharding(mesh, PartitionSpec("data", "model"))
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = max(8, (total - 4 * sum(small)) // (4 * cols * 4) // 8 * 8)
    tree: dict[str, Any] = {"params": {}, "opt_state": {}}
    for i in range(4):  # embeddings and MLP kernels
        tree["params"][f"layer_{i}"] = {"kernel": _fill((rows, cols), sharded, seed, i)}
    for j, n in enumerate(small):  # biases, norms, optimizer statistics
        group = tree["params"] if j % 2 == 0 else tree["opt_state"]
        leaf = _fill((n,), replicated, seed, 1000 + j)
        group.setdefault(f"block_{j // 6}", {})[f"v{j % 6}"] = leaf
    return tree


def tree_a(scale: float, seed: int, n_small: int = 300) -> Built:
    total = int(scale * 1024 * MiB)
    n_small = max(8, round(n_small * min(1.0, scale * 4)))
    small = [int(n) for n in np.random.default_rng(seed).integers(1024, 16385, n_small)]
    cols = 8192 if total >= 256 * MiB else 1024
    tree = _large_and_small(total, small, seed, cols)
    return tree, abstract_of(tree)


def tree_b(scale: float, seed: int) -> Built:
    total = int(scale * 434 * MiB)
    n_small = max(8, round(200 * scale))
    small_elems = (256 << 10) // 4
    tree = _large_and_small(total, [small_elems] * n_small, seed, 4096)
    return tree, abstract_of(tree)


def tree_c(scale: float, seed: int) -> Built:
    rng = np.random.default_rng(seed)
    count = max(16, round(5000 * scale))
    sizes = np.exp(rng.uniform(np.log(16 * 1024), np.log(MiB), count)).astype(int) // 4
    replicated = NamedSharding(_mesh((4, 2)), PartitionSpec())
    tree: dict[str, Any] = {}
    for j, n in enumerate(sizes):
        group = tree.setdefault(f"module_{j // 50}", {})
        group[f"t{j % 50}"] = _fill((int(n),), replicated, seed, j)
    return tree, abstract_of(tree)


def tree_d(scale: float, seed: int) -> Built:
    total = int(scale * 1024 * MiB)
    cols = 8192 if total >= 256 * MiB else 1024
    rows = max(8, total // (2 * cols * 4) // 8 * 8)
    saved = NamedSharding(_mesh((4, 2)), PartitionSpec("data", "model"))
    tree = {f"huge_{i}": _fill((rows, cols), saved, seed, i) for i in range(2)}
    other = NamedSharding(_mesh((2, 4)), PartitionSpec("data", "model"))  # rows / 2, cols / 4
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for k, v in tree.items()}
    return tree, abstract


TREES: dict[str, Callable[[float, int], Built]] = {
    "a": tree_a,
    "b": tree_b,
    "c": tree_c,
    "d": tree_d,
}


def abstract(name: str, scale: float, seed: int) -> Any:
    """Tree ``name``'s restore target alone, without building (allocating) its data."""
    _ABSTRACT_ONLY[0] = True
    try:
        return TREES[name](scale, seed)[1]
    finally:
        _ABSTRACT_ONLY[0] = False
