"""Helpers the checkpoint tests share with other tests: trees, targets, stalls, assertions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptstore.backends.base import Backend
from ckptstore.protocol import digest, load_committed
from ckptstore.testing.arrays import random_array
from ckptstore.testing.faults import FaultyBackend
from tests.paths import committed_root

T = TypeVar("T")

# ---- targets and partial saves (test_partial.py) ----


def part_tree(k: int) -> dict[str, Any]:
    rng = np.random.default_rng(k)
    return {
        "layers": {
            str(k): {
                "w": rng.standard_normal((64, 32)).astype(np.float32),
                "b": np.full(32, k, np.int16),
            }
        }
    }


def shared_target(kind: str, request: pytest.FixtureRequest, tmp_path: Path, name: str) -> str:
    """A target another process can open too: a path, or a profile naming an emulator."""
    if kind == "local":
        return str(tmp_path / name)
    if kind == "s3":
        server, bucket = (
            request.getfixturevalue("ckptstore_s3_server"),
            request.getfixturevalue("ckptstore_s3_bucket"),
        )
        url, options = f"s3://{bucket}/{name}", 'credentials = "env"'
    else:
        server = request.getfixturevalue("ckptstore_gcs_server")
        bucket = request.getfixturevalue("ckptstore_gcs_bucket")
        url, options = f"gs://{bucket}/{name}", 'credentials = "anonymous"\nemulator = true'
    profile = tmp_path / f"{name}.toml"
    profile.write_text(f'url = "{url}"\n[options]\nendpoint = "{server.endpoint}"\n{options}\n')
    return str(profile)


# ---- the commit protocol (test_commit.py) ----

FIXTURE_V1 = Path(__file__).parents[1].joinpath("fixtures") / "v1"


def sharded(values: np.ndarray) -> jax.Array:
    """``values`` spread over 8 CPU devices: one chunk per shard."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    return jax.device_put(values, NamedSharding(mesh, P("d")))


def tree_of(k: int) -> dict[str, Any]:
    return {"x": np.full(64, k, np.int32), "w": sharded(np.arange(64.0, dtype=np.float32) * k)}


def assert_is_tree(restored: dict[str, Any], k: int) -> None:
    np.testing.assert_array_equal(restored["x"], np.full(64, k, np.int32))
    np.testing.assert_array_equal(restored["w"], np.arange(64.0, dtype=np.float32) * k)


async def snapshot(backend: Backend, prefix: str) -> dict[str, bytes]:
    """Every object below ``prefix`` with its bytes."""
    keys = [info.key async for info in backend.list(prefix)]
    return {k: await backend.read(k) for k in keys}


class Stalled(FaultyBackend):
    """Pauses one operation (the first matching one) until released."""

    def __init__(self, inner: Backend, op: str, suffix: str, *, after: bool = False):
        super().__init__(inner)
        self.op, self.suffix, self.stall_after = op, suffix, after
        self.reached, self.release = asyncio.Event(), asyncio.Event()

    async def _around(self, op: str, key: str | None, call: Callable[[], Awaitable[T]]) -> T:
        stall = op == self.op and (key or "").endswith(self.suffix) and not self.reached.is_set()
        if stall and not self.stall_after:
            await self._pause()
        try:
            return await call()
        finally:
            if stall and self.stall_after:
                await self._pause()

    async def _pause(self) -> None:
        self.reached.set()
        await self.release.wait()


#: Where a writer stalls: right after its "is the step committed?" check, or with all its
#: data written and merged, just before it writes its manifest and creates the marker.
STALLS = {"checked": ("list_dir", "5", True), "merged": ("write", "manifest.json", False)}


async def resign(backend: Backend, step: int, manifest: bytes) -> None:
    """Replace a committed step's manifest and fix its marker's digest: a forger's edit."""
    marker = json.loads(await backend.read(f"{step}/COMMITTED"))
    await backend.write(f"{await committed_root(backend, step)}/manifest.json", manifest)
    marker["manifest_digest"] = digest(manifest)
    await backend.write(f"{step}/COMMITTED", json.dumps(marker).encode())


# ---- incremental saves (test_incremental.py) ----

FROZEN = np.arange(2 << 20, dtype=np.float32).reshape(2048, 1024)  # 8 MiB: never changes


def lora(k: int) -> dict[str, Any]:
    """A frozen base (a large leaf, a small packed one) and adapters that change with k."""
    return {
        "base": {"w": FROZEN, "norm": np.linspace(0, 1, 7, dtype=np.float32)},
        "adapter": {"a": np.full((64, 16), k, np.float32), "b": np.full((16, 64), -k, np.int32)},
        "step": k,
    }


def assert_same(got: Any, want: Any) -> None:
    flat_got, tree_got = jax.tree_util.tree_flatten(got)
    flat_want, tree_want = jax.tree_util.tree_flatten(want)
    assert tree_got == tree_want
    for g, w in zip(flat_got, flat_want, strict=True):
        assert type(g) is type(w) or isinstance(w, np.ndarray)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.asarray(g).dtype == np.asarray(w).dtype


async def stored_bytes(backend: Backend, step: int) -> int:
    return sum(o.size for o in [o async for o in backend.list(await committed_root(backend, step))])


async def holders(backend: Backend, step: int) -> set[tuple[int, str]]:
    manifest = await load_committed(backend, step)
    return {(r.step, r.attempt) for r in manifest.references}


# ---- typed PRNG keys (test_prng_keys.py) ----


def _known(impl: str) -> bool:
    try:
        jax.random.key(0, impl=impl)
    except ValueError:
        return False
    return True


# Every implementation this jax registers by name (threefry2x32, rbg and unsafe_rbg always).
IMPLS = [
    name
    for name in ("threefry2x32", "rbg", "unsafe_rbg", "philox2x32", "philox4x32", "threefry4x32")
    if _known(name)
]


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def keys_tree(impl: str) -> dict[str, Any]:
    root = jax.random.key(7, impl=impl)
    return {
        "one": root,
        "batch": jax.random.split(root, 6),
        "grid": jax.random.split(jax.random.fold_in(root, 1), (2, 3)),
        "w": np.arange(4, dtype=np.float32),
    }


def assert_same_keys(got: Any, want: jax.Array) -> None:
    assert isinstance(got, jax.Array)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert jax.random.key_impl(got) == jax.random.key_impl(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
    # Bit-exact keys draw the same numbers.
    bits = jax.vmap(jax.random.bits)
    flat = (-1,) if want.shape else ()
    np.testing.assert_array_equal(
        (bits if want.shape else jax.random.bits)(got.reshape(flat)),
        (bits if want.shape else jax.random.bits)(want.reshape(flat)),
    )


# ---- a busy event loop (test_event_loop.py) ----

MiB = 1 << 20
Built = tuple[dict[str, Any], dict[str, Any]]


def _with_like(tree: dict[str, Any]) -> Built:
    """The tree, and the abstract tree that restores it onto the shardings it was saved with."""
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    return tree, like


def large_and_small(scale: float, seed: int) -> Built:
    """4 large leaves sharded over a (4, 2) mesh and up to 300 small replicated ones of 4-64
    KiB (biases, norms), 1 GiB at scale 1: benchmarks/trees.py's tree ``a``."""
    total = int(scale * 1024 * MiB)
    n_small = max(8, round(300 * min(1.0, scale * 4)))
    small = [int(n) for n in np.random.default_rng(seed).integers(1024, 16385, n_small)]
    cols = 8192 if total >= 256 * MiB else 1024
    rows = max(8, (total - 4 * sum(small)) // (4 * cols * 4) // 8 * 8)
    sharded, replicated = NamedSharding(mesh(), P("x", "y")), NamedSharding(mesh(), P())
    tree: dict[str, Any] = {"params": {}, "opt_state": {}}
    for i in range(4):
        tree["params"][f"layer_{i}"] = {"kernel": random_array((rows, cols), sharded, seed, i)}
    for j, n in enumerate(small):
        group = tree["params"] if j % 2 == 0 else tree["opt_state"]
        leaf = random_array((n,), replicated, seed, 1000 + j)
        group.setdefault(f"block_{j // 6}", {})[f"v{j % 6}"] = leaf
    return _with_like(tree)


def many_small(scale: float, seed: int) -> Built:
    """5,000 replicated leaves of 16 KiB to 1 MiB (log-uniform), 1.15 GiB at scale 1, an
    optimizer state of many small tensors: benchmarks/trees.py's tree ``c``."""
    rng = np.random.default_rng(seed)
    count = max(16, round(5000 * scale))
    sizes = np.exp(rng.uniform(np.log(16 * 1024), np.log(MiB), count)).astype(int) // 4
    replicated = NamedSharding(mesh(), P())
    tree: dict[str, Any] = {}
    for j, n in enumerate(sizes):
        group = tree.setdefault(f"module_{j // 50}", {})
        group[f"t{j % 50}"] = random_array((int(n),), replicated, seed, j)
    return _with_like(tree)
