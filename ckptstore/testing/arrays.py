"""Reproducible random float32 arrays on a sharding, made shard by shard: the trees that
benchmarks and tests save and restore (`benchmarks/trees.py`, `tests/checkpoint/helpers.py`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from ckptstore.runtime.hostpool import aligned_empty


def random_array(shape: tuple[int, ...], sharding: Sharding, seed: int, salt: int) -> jax.Array:
    """Random float32 data of ``shape`` on ``sharding``, each shard drawn from ``seed``,
    ``salt`` and its offset (the same values whatever the mesh), ready when returned.

    A replicated array is one aligned host buffer that every CPU device adopts (as a
    restore builds them), not a copy per device: a tree of thousands of replicated leaves
    would otherwise be held eight times. Ready before it is returned: an array still being
    made finishes (and its memory lands) inside whatever is measured next."""

    def piece(index: Any) -> np.ndarray[Any, Any]:  # a tuple of slices
        shard = [len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True)]
        rng = np.random.default_rng([seed, salt, *(s.start or 0 for s in index)])
        return rng.random(shard, dtype=np.float32)

    if sharding.is_fully_replicated:
        host = aligned_empty(shape, np.dtype(np.float32))
        host[...] = piece(tuple(slice(None) for _ in shape))
        out: jax.Array = jax.device_put(host, sharding)
    else:
        out = jax.make_array_from_callback(shape, sharding, piece)
    out.block_until_ready()
    return out
