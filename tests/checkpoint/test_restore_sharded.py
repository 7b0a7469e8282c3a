"""Sharded saves and resharding restores on 8 CPU devices in one process."""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends.base import Backend
from tests.paths import committed_root


def mesh(shape: tuple[int, int], names: tuple[str, str] = ("x", "y")) -> Mesh:
    devices = np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return Mesh(devices, names)


@pytest.fixture(scope="module", autouse=True)
def eight_devices() -> None:
    if len(jax.devices()) < 8:
        pytest.fail(f"need 8 CPU devices (XLA_FLAGS), have {len(jax.devices())}")


def sharded_tree() -> dict[str, jax.Array]:
    m = mesh((4, 2))
    data = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    return {
        "w": jax.device_put(data, NamedSharding(m, P("x", "y"))),
        "rows": jax.device_put(data[:, :8] * 2, NamedSharding(m, P("x"))),
        "replicated": jax.device_put(np.arange(10.0), NamedSharding(m, P())),
        "cube": jax.device_put(np.arange(120.0).reshape(8, 3, 5), NamedSharding(m, P("x"))),
    }


async def test_save_sharded_restore_on_transposed_mesh(any_backend: Backend) -> None:
    tree = sharded_tree()
    result = await ckptstore.save(any_backend, tree, step=1)
    # Replicated data is written once: bytes written equal the payload.
    assert result.bytes_written == result.bytes

    m = mesh((2, 4), ("a", "b"))
    like = {
        "w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(m, P("b", "a"))),
        "rows": jax.ShapeDtypeStruct((64, 8), np.float32, sharding=NamedSharding(m, P(None, "b"))),
        "replicated": jax.ShapeDtypeStruct((10,), np.float32, sharding=NamedSharding(m, P())),
        "cube": jax.ShapeDtypeStruct((8, 3, 5), np.float32, sharding=NamedSharding(m, P("a"))),
    }
    out = await ckptstore.restore(any_backend, like=like)
    for name, arr in out.items():
        assert isinstance(arr, jax.Array)
        assert arr.sharding == like[name].sharding
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(tree[name]))


async def test_restore_onto_one_device_and_as_numpy(any_backend: Backend) -> None:
    tree = sharded_tree()
    await ckptstore.save(any_backend, tree, step=1)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=single) for k, v in tree.items()}
    out = await ckptstore.restore(any_backend, like=like)
    as_numpy = await ckptstore.restore(any_backend)
    for name in tree:
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(tree[name]))
        assert isinstance(as_numpy[name], np.ndarray)
        np.testing.assert_array_equal(as_numpy[name], np.asarray(tree[name]))


async def test_restore_like_live_arrays_and_cast(any_backend: Backend) -> None:
    tree = sharded_tree()
    await ckptstore.save(any_backend, tree, step=1)
    m = mesh((8, 1))
    like = {
        k: jax.ShapeDtypeStruct(v.shape, np.float16, sharding=NamedSharding(m, P("x")))
        for k, v in tree.items()
        if v.shape[0] % 8 == 0
    }
    with pytest.raises(ckptstore.TreeMismatchError) as info:
        await ckptstore.restore(any_backend, like=like, partial=True)
    assert len(info.value.problems) == len(like)  # every dtype mismatch, listed together
    out = await ckptstore.restore(any_backend, like=like, partial=True, cast=True)
    for name, arr in out.items():
        assert arr.dtype == np.float16
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(tree[name]).astype(np.float16))


async def test_chunks_follow_shards(any_backend: Backend) -> None:
    tree = sharded_tree()
    await ckptstore.save(any_backend, tree, step=1)
    manifest = await ckptstore.read_manifest(any_backend, 1)
    leaves = manifest.items["state"].leaves
    assert leaves["w"].chunk_shape == (16, 16)
    assert leaves["rows"].chunk_shape == (16, 8)
    assert leaves["w"].sharding == {"type": "named", "mesh": {"x": 4, "y": 2}, "spec": ["x", "y"]}


async def test_restored_host_buffers_are_shared_and_safe_to_donate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On CPU a restored slice is handed to its devices without a copy (every device of a
    replicated leaf shares one buffer), and donating the result never changes the other
    replicas, a second restore, or the stored data."""
    m = mesh((4, 2))
    rep, rows = NamedSharding(m, P()), NamedSharding(m, P("x"))
    big = np.arange(1 << 19, dtype=np.float32).reshape(512, 1024)  # 2 MiB: one chunk per shard
    tree = {
        "big_rep": jax.device_put(big, rep),
        "big_rows": jax.device_put(big, rows),
        "small": jax.device_put(np.arange(16.0, dtype=np.float32), rep),
    }
    await ckptstore.save(str(tmp_path), tree, step=1)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    first = await ckptstore.restore(str(tmp_path), like=like)
    pointers = {s.data.unsafe_buffer_pointer() for s in first["big_rep"].addressable_shards}
    assert len(pointers) == 1, "replicas of a restored leaf should share one host buffer"
    step = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a + 1, t), donate_argnums=0)
    out = first
    for _ in range(3):
        out = step(out)
    second = await ckptstore.restore(str(tmp_path), like=like)
    for name, value in tree.items():
        want = np.asarray(value)
        for shard in out[name].addressable_shards:  # every replica saw exactly 3 additions
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index] + 3)
        np.testing.assert_array_equal(np.asarray(second[name]), want)


@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "complex64", "bfloat16"])
def test_replicated_leaves_placed_by_jax_own_transfer_equal_device_put(dtype: str) -> None:
    """`placement.put_replicated` (JAX's transfer without `jax.device_put`'s Python layers)
    is taken with the JAX this project pins, and builds what `jax.device_put` builds."""
    from ckptstore.datapath import placement
    from ckptstore.format.leaves import dtype_of
    from ckptstore.runtime.hostpool import aligned_empty

    assert placement._device_put is not None, "JAX's transfer entry point moved"
    m = mesh((4, 2))
    rep, rows = NamedSharding(m, P()), NamedSharding(m, P("x"))
    value = aligned_empty((8, 6), dtype_of(dtype))
    value[...] = np.arange(48).reshape(8, 6).astype(value.dtype)
    fast = placement.put_replicated(value, rep)
    assert placement.put_replicated(value, rows) is None  # sharded: jax.device_put's job
    if dtype == "bfloat16":  # not a NumPy kind JAX hands through as is: left to device_put
        assert fast is None
        return
    want = jax.device_put(value, rep)
    assert isinstance(fast, jax.Array) and fast.sharding == want.sharding
    assert fast.dtype == want.dtype and fast.shape == want.shape and fast.committed
    devices = [s.device for s in want.addressable_shards]
    assert [s.device for s in fast.addressable_shards] == devices
    np.testing.assert_array_equal(np.asarray(fast), value)
    total = jax.jit(lambda a: a.sum())
    np.testing.assert_array_equal(np.asarray(total(fast)), np.asarray(total(want)))


def test_a_replicated_leaf_is_one_piece_written_from_its_first_buffer() -> None:
    """Replicated over CPU devices, a leaf is written from the array itself (no jax array
    per device is made: ~150 us a leaf), and TensorStore reads its first device's buffer
    in place; a sharded leaf still gives one piece per shard."""
    from ckptstore.datapath.arrays import host_view, owned_slices

    m = mesh((4, 2))
    value = jax.device_put(np.arange(1 << 20, dtype=np.float32), NamedSharding(m, P()))
    pieces = owned_slices(value, 0)
    assert len(pieces) == 1 and pieces[0][1] is value and pieces[0][2]
    assert pieces[0][0] == (slice(None),)
    view = host_view(value)
    assert view is not None
    assert view.ctypes.data == value.addressable_data(0).unsafe_buffer_pointer()
    sharded = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(m, P("x", "y")))
    assert len(owned_slices(sharded, 0)) == 8


def _count_chunk_reads(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Every chunk key the restore's readers fetch, counted (the real readers still read)."""
    from ckptstore.datapath.ocdbt_index import DirectChunks
    from ckptstore.datapath.reads import KvChunks

    fetched: collections.Counter[str] = collections.Counter()
    for cls in (KvChunks, DirectChunks):
        real = cls.get

        async def get(self: Any, keys: Any, _real: Any = real) -> Any:
            fetched.update(keys)
            return await _real(self, keys)

        monkeypatch.setattr(cls, "get", get)
    return fetched


async def test_a_chunk_several_slices_overlap_is_read_once(
    any_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restored onto a mesh whose slices each take half of two saved chunks, every chunk
    is fetched (and checked) once, not once per slice that overlaps it."""
    data = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    saved = NamedSharding(mesh((4, 2)), P("x", "y"))  # chunks of 16 x 16
    await ckptstore.save(any_backend, {"w": jax.device_put(data, saved)}, step=1)
    target = NamedSharding(mesh((2, 4)), P("x", "y"))  # slices of 32 x 8: two chunks' halves
    like = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=target)}
    fetched = _count_chunk_reads(monkeypatch)
    out = await ckptstore.restore(any_backend, like=like)
    np.testing.assert_array_equal(np.asarray(out["w"]), data)
    chunk_reads = {key: n for key, n in fetched.items() if key.startswith("w/c/")}
    assert sorted(chunk_reads) == [f"w/c/{i}/{j}" for i in range(4) for j in range(2)]
    assert set(chunk_reads.values()) == {1}, chunk_reads


async def test_a_damaged_chunk_several_slices_share_fails_every_one_of_them(
    any_backend: Backend,
) -> None:
    """A chunk shared by several slices is read once; its damage is reported (naming the
    leaf), not hidden behind the slice that read it first."""
    data = np.random.default_rng(4).standard_normal((512, 256)).astype(np.float32)
    saved = NamedSharding(mesh((4, 2)), P("x", "y"))
    await ckptstore.save(any_backend, {"w": jax.device_put(data, saved)}, step=1)
    root = await committed_root(any_backend, 1)
    files = [info async for info in any_backend.list(f"{root}/state/ocdbt.process_0")]
    key = max(files, key=lambda info: info.size).key
    damaged = bytearray(await any_backend.read(key))
    for at in range(0, len(damaged), 4096):  # every chunk in the file
        damaged[at] ^= 0x40
    await any_backend.write(key, bytes(damaged))
    target = NamedSharding(mesh((2, 4)), P("x", "y"))
    like = {"w": jax.ShapeDtypeStruct(data.shape, np.float32, sharding=target)}
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        await ckptstore.restore(any_backend, like=like)
    assert info.value.leaf == "w"


async def test_slices_laid_out_from_several_chunks_go_to_devices_without_a_copy(
    any_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice assembled from parts of several chunks is built in a buffer CPU devices
    adopt as it is; an unaligned one would be copied once more on its way to them."""
    from ckptstore.datapath import placement

    data = np.random.default_rng(5).standard_normal((64, 32)).astype(np.float32)
    saved = NamedSharding(mesh((4, 2)), P("x", "y"))
    await ckptstore.save(any_backend, {"w": jax.device_put(data, saved)}, step=1)
    handed: list[bool] = []
    real = placement.put_slice

    async def put_slice(value: np.ndarray[Any, Any], devices: Any) -> Any:
        handed.append(placement.adoptable(value))
        return await real(value, devices)

    monkeypatch.setattr(placement, "put_slice", put_slice)
    target = NamedSharding(mesh((2, 4)), P("x", "y"))  # every slice spans two chunks
    like = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=target)}
    out = await ckptstore.restore(any_backend, like=like)
    np.testing.assert_array_equal(np.asarray(out["w"]), data)
    assert handed == [True] * 8


async def test_the_zarr_json_of_leaves_read_alone_is_fetched_in_one_batch(
    any_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every leaf restored chunk by chunk has its ``zarr.json`` checked first: one batch of
    lookups for all of them (nearby values in one read), not a round trip per leaf that
    queues behind large reads. A leaf whose ``zarr.json`` was rewritten (still valid)
    goes through TensorStore's reader instead, the others still do not."""
    import json

    import tensorstore as ts

    from ckptstore.datapath.ocdbt_index import DirectChunks
    from ckptstore.datapath.reads import KvChunks
    from ckptstore.datapath.stores import ocdbt_spec

    tree = sharded_tree()
    await ckptstore.save(any_backend, tree, step=1)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    batches: list[list[str]] = []
    for cls in (KvChunks, DirectChunks):
        real = cls.get

        async def get(self: Any, keys: Any, _real: Any = real) -> Any:
            metas = [key for key in keys if key.endswith("zarr.json")]
            if metas:
                batches.append(metas)
            return await _real(self, keys)

        monkeypatch.setattr(cls, "get", get)
    out = await ckptstore.restore(any_backend, like=like)
    alone = {"w/zarr.json", "rows/zarr.json", "cube/zarr.json"}  # multi-chunk: not packed
    assert [set(batch) & alone for batch in batches] == [alone], batches

    manifest = await ckptstore.read_manifest(any_backend, 1)
    store = ocdbt_spec(any_backend.kvstore_spec(manifest.item_dir("state")))
    kv = await ts.KvStore.open(store, context=any_backend.ts_context)
    meta = json.loads((await kv.read("w/zarr.json")).value)
    await kv.write("w/zarr.json", json.dumps(meta, indent=2).encode())
    opened = []
    real_open = ckptstore.checkpoint.restore.open_leaf

    async def open_leaf(store: Any, ctx: Any, info: Any) -> Any:
        opened.append(info.name)
        return await real_open(store, ctx, info)

    monkeypatch.setattr(ckptstore.checkpoint.restore, "open_leaf", open_leaf)
    again = await ckptstore.restore(any_backend, like=like)
    assert opened == ["w"]
    for name, value in tree.items():
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(value))
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(value))


async def test_slices_sharing_a_chunk_pass_the_budget_together_whatever_the_device_order(
    any_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a mesh whose device order scatters the slices that share a chunk, they still
    go through the read-ahead budget one after another: a shared chunk is not
    kept while unrelated slices are read (with a budget of one slice, at most the two
    chunks of the slices in flight are held, not every chunk of the leaf)."""
    from ckptstore.datapath.rawleaf import RawLeaf

    data = np.random.default_rng(6).standard_normal((64, 32)).astype(np.float32)
    saved = NamedSharding(mesh((4, 2)), P("x", "y"))  # 8 chunks of 16 x 16
    await ckptstore.save(any_backend, {"w": jax.device_put(data, saved)}, step=1)
    # Rows split by the mesh's second axis, columns by its first: in device order, the
    # slices of one chunk column come one row band after another, its sharers 2 apart.
    target = NamedSharding(mesh((4, 2), ("a", "b")), P("b", "a"))  # slices of 32 x 8
    held: list[int] = []
    real = RawLeaf._fetch_shared

    async def fetch_shared(self: Any, keys: Any) -> Any:
        got = await real(self, keys)
        held.append(sum(1 for entry in self._shared.values() if entry.piece is not None))
        return got

    monkeypatch.setattr(RawLeaf, "_fetch_shared", fetch_shared)
    like = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=target)}
    out = await ckptstore.restore(any_backend, like=like, max_inflight_bytes=32 * 8 * 4)
    np.testing.assert_array_equal(np.asarray(out["w"]), data)
    assert len(held) == 8 and max(held) <= 2, held
