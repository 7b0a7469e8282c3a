"""Helpers the manager tests share: incremental runs' sizes and checks, a racing deleter."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.testing.faults import FaultyBackend
from tests.lifecycle.incremental_worker import FROZEN_SHAPE

# ---- incremental runs (test_manager_incremental.py) ----

FROZEN = FROZEN_SHAPE[0] * FROZEN_SHAPE[1] * 4
CHANGED = 3 * 1024 * 8 * 4  # lora a and b, opt mu: float32
#: What a step's attempt holds besides its leaves' chunks: zarr.json files, OCDBT
#: manifests and B-tree nodes, digests, the manifest and the marker.
OVERHEAD = 64 << 10


def options(**kw: Any) -> ckptstore.ManagerOptions:
    return ckptstore.ManagerOptions(handle_sigterm=False, incremental=True, **kw)


def host(state: Any) -> Any:
    return jax.tree.map(np.asarray, state)


def assert_bit_exact(got: Any, want: Any) -> None:
    flat_got, tree_got = jax.tree_util.tree_flatten(got)
    flat_want, tree_want = jax.tree_util.tree_flatten(want)
    assert tree_got == tree_want
    for g, w in zip(flat_got, flat_want, strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


# ---- another process deleting steps (test_manager.py) ----


class _DeletedFirst(FaultyBackend):
    """A backend on which another process deletes a step just before this one reads its
    marker (armed by `_DropsOlder`)."""

    def __init__(self, inner: Backend):
        super().__init__(inner)
        self.armed: set[int] = set()

    async def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        step = key.split("/")[0]
        if "/COMMITTED" in key and step.isdigit() and int(step) in self.armed:
            self.armed.discard(int(step))
            await ckptstore.delete_step(self.inner, int(step))  # `ckptstore rm` elsewhere
        return await self.inner.read(key, start, end)
