"""Small leaves written as raw zarr3 keys are exactly what TensorStore writes and reads."""

from __future__ import annotations

import asyncio
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.datapath.reads import open_leaf, read_slice
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import chunks
from ckptstore.format.leaves import LeafInfo, describe_leaf, zarr_spec
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.hostpool import ALIGNMENT, aligned_empty

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "bool", "complex64", "int8", "uint64"]
SHAPES = [(), (3,), (2, 5), (1, 1, 7)]


def _value(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "complex64":
        return (rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64)
    np_dtype = getattr(ml_dtypes, dtype, None) or np.dtype(dtype)
    return (rng.random(shape) * 100).astype(np_dtype)


def _written_by_tensorstore(info: LeafInfo, value: np.ndarray[Any, Any]) -> dict[str, bytes]:
    ctx = ts.Context()
    arr = ts.open(zarr_spec({"driver": "memory"}, info), create=True, context=ctx).result()
    arr.write(value).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_keys_and_bytes_are_what_tensorstore_writes(dtype: str, shape: tuple[int, ...]) -> None:
    value = _value(dtype, shape)
    info = describe_leaf("a/b", value)
    assert chunks.small(info)
    want = _written_by_tensorstore(info, value)
    got = {
        chunks.metadata_key(info): chunks.encode_metadata(info),
        chunks.chunk_key(info): chunks.encode_chunk(info, value),
    }
    assert got == want
    back = chunks.decode_chunk(info, got[chunks.chunk_key(info)])
    assert back.dtype == value.dtype and back.shape == value.shape
    assert back.tobytes() == value.tobytes()
    assert back.flags.writeable


def test_checksum_is_crc32c_as_tensorstore_computes_it() -> None:
    # The CRC-32C check value (RFC 3720's polynomial), then a buffer past the size from
    # which the checksum runs without the interpreter lock.
    assert chunks.checksum(np.frombuffer(b"123456789", np.uint8)) == bytes.fromhex("839206e3")
    value = _value("float32", (300_000,))
    info = describe_leaf("big", value)
    stored = _written_by_tensorstore(info, value)[chunks.chunk_key(info)]
    assert chunks.checksum(value.view(np.uint8)) == stored[-4:]
    assert chunks.encode_chunk(info, value) == stored


def test_non_contiguous_and_big_endian_inputs_encode_as_little_endian_c_order() -> None:
    base = np.arange(24, dtype=">i4").reshape(4, 6)
    value = base[:, ::2]  # neither contiguous nor native
    info = describe_leaf("x", np.ascontiguousarray(value, dtype="<i4"))
    chunk = chunks.encode_chunk(info, value)
    want = _written_by_tensorstore(info, value.astype("<i4"))
    assert chunk == want[chunks.chunk_key(info)]


def test_which_leaves_take_the_raw_key_path() -> None:
    small = describe_leaf("s", np.zeros((256, 256), np.float32))
    assert chunks.small(small)
    big = describe_leaf("b", np.zeros((2048, 1024), np.float32))  # 8 MiB
    assert not chunks.small(big)
    empty = describe_leaf("e", np.zeros((0, 4), np.float32))
    assert not chunks.small(empty)
    chunked = describe_leaf("c", np.zeros((64, 64), np.float32), target_chunk=4096)
    assert chunked.chunk_shape != chunked.shape and not chunks.small(chunked)


def test_damaged_chunks_are_corruption_naming_the_leaf() -> None:
    value = np.arange(10, dtype=np.float32)
    info = describe_leaf("layer/w", value)
    chunk = bytearray(chunks.encode_chunk(info, value))
    chunk[3] ^= 1
    with pytest.raises(CorruptCheckpointError, match="checksum") as err:
        chunks.decode_chunk(info, bytes(chunk))
    assert "layer/w" in str(err.value)
    with pytest.raises(CorruptCheckpointError, match="holds 43 bytes, 44 expected"):
        chunks.decode_chunk(info, bytes(chunk[:-1]))


def test_groups_bound_bytes_and_count() -> None:
    infos = [
        (describe_leaf(f"x{i}", np.zeros(n, np.uint8)), i) for i, n in enumerate([5, 5, 20, 1])
    ]
    grouped = chunks.groups(infos, max_bytes=10, max_count=3)
    assert [[v for _, v in g] for g in grouped] == [[0, 1], [2], [3]]
    assert [[v for _, v in g] for g in chunks.groups(infos, 100, max_count=2)] == [
        [0, 1],
        [2, 3],
    ]


async def save_as_raw_keys(path: str, tree: Any) -> int:
    """A step whose small leaves are raw keys in OCDBT stores, not packs (a save packs
    them; partial saves and host-local fast tiers write raw keys). Returns the bytes."""
    session = await ckptstore.partial_save(path, step=1)
    part = await session.add(tree)
    await session.finalize()
    return part.nbytes


async def test_saved_small_leaves_read_back_through_tensorstore(tmp_path: Any) -> None:
    tree = {d: {str(i): _value(d, s, i) for i, s in enumerate(SHAPES)} for d in DTYPES}
    written = await save_as_raw_keys(str(tmp_path), tree)
    manifest = await ckptstore.read_manifest(str(tmp_path), 1)
    from ckptstore.backends.registry import open_backend
    from ckptstore.datapath.stores import ocdbt_spec

    backend = open_backend(str(tmp_path))
    try:
        store = ocdbt_spec(backend.kvstore_spec(manifest.item_dir("state")))
        for name, info in manifest.items["state"].leaves.items():
            arr = await open_leaf(store, backend.ts_context, info)  # TensorStore's own reader
            dtype, index = name.split("/")
            got = await read_slice(arr, (), name)
            assert got.tobytes() == tree[dtype][index].tobytes(), name
    finally:
        await backend.close()
    assert written == sum(v.nbytes for g in tree.values() for v in g.values())


# ---- the byte budget that bounds a save's (and promotion's) copies ----


async def test_budget_admits_in_order_and_never_exceeds_its_limit() -> None:
    budget = ByteBudget(10)
    order: list[int] = []
    peak = 0

    async def use(i: int, nbytes: int) -> None:
        nonlocal peak
        async with budget.hold(nbytes):
            order.append(i)
            peak = max(peak, budget.used)
            await asyncio.sleep(0.01)

    await asyncio.gather(*(use(i, n) for i, n in enumerate([6, 6, 3, 25, 1])))
    assert order == [0, 1, 2, 3, 4]  # first come, first served: 1 byte waits behind 25
    assert budget.used == 0
    assert peak <= 25  # only a piece larger than the budget passes, and alone


async def test_cancelled_waiters_give_their_place_back() -> None:
    budget = ByteBudget(10)
    async with budget.hold(8):
        waiting = asyncio.create_task(_hold(budget, 5))
        behind = asyncio.create_task(_hold(budget, 2))
        await asyncio.sleep(0.01)
        assert not waiting.done() and not behind.done()
        waiting.cancel()
        await asyncio.sleep(0.01)
        assert behind.done()  # 8 + 2 fit once the 5 left the queue
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert budget.used == 0


async def test_cancelling_holder_and_waiters_together_leaves_the_budget_empty() -> None:
    """What cancelling a ``gather`` of copies does (a promotion stopped by SIGTERM): every
    waiter's future is cancelled before the holder releases its bytes."""
    budget = ByteBudget(10)

    async def hold_long(nbytes: int) -> None:
        async with budget.hold(nbytes):
            await asyncio.sleep(60)

    holder = asyncio.create_task(hold_long(8))
    await asyncio.sleep(0.01)
    waiters = [asyncio.create_task(hold_long(5)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert budget.used == 8 and len(budget._waiters) == 3
    for task in [holder, *waiters]:  # as gather does: the holder resumes first, and finds
        task.cancel()  # the waiters' futures already cancelled
    results = await asyncio.gather(holder, *waiters, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert budget.used == 0 and not budget._waiters
    await asyncio.wait_for(_hold(budget, 10), 1)  # and it still admits


async def _hold(budget: ByteBudget, nbytes: int) -> None:
    async with budget.hold(nbytes):
        pass


# ---- restores: batches of small leaves, and the read-ahead budget ----


def _mixed_tree() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "big": rng.random((1024, 1280), dtype=np.float32),  # 5 MiB: TensorStore's path
        "small": {str(i): rng.random((100 + i,), dtype=np.float32) for i in range(40)},
        "n": 3,
    }


async def test_restore_reads_within_its_budget_and_bit_exact(tmp_path: Any) -> None:
    from ckptstore.backends.registry import open_backend
    from ckptstore.checkpoint.assemble import restore_stored
    from ckptstore.checkpoint.restore import open_stored

    tree = _mixed_tree()
    await ckptstore.save(str(tmp_path), tree, step=1)
    backend = open_backend(str(tmp_path))
    try:
        for limit in (64 << 10, 1 << 30):
            budget = ByteBudget(limit)
            stored = await open_stored(backend, 1, "state")
            got = await restore_stored(stored, None, partial=False, cast=False, budget=budget)
            assert got["big"].tobytes() == tree["big"].tobytes() and got["n"] == 3
            assert all(got["small"][k].tobytes() == v.tobytes() for k, v in tree["small"].items())
            largest = tree["big"].nbytes
            assert budget.used == 0 and budget.peak <= max(limit, largest)
            if limit < largest:
                assert budget.peak == largest  # the big leaf was read alone
    finally:
        await backend.close()


async def test_an_unusual_small_leaf_is_read_by_tensorstore_and_damage_is_named(
    tmp_path: Any,
) -> None:
    """A small leaf whose zarr.json is not byte-identical to what a save writes (an
    older writer, a hand edit that keeps it valid) still restores; a damaged chunk
    of one is corruption that names it."""
    import json

    from ckptstore.backends.registry import open_backend
    from ckptstore.datapath.stores import ocdbt_spec

    tree = _mixed_tree()
    await save_as_raw_keys(str(tmp_path), tree)
    manifest = await ckptstore.read_manifest(str(tmp_path), 1)
    backend = open_backend(str(tmp_path))
    try:
        kv = await ts.KvStore.open(ocdbt_spec(backend.kvstore_spec(manifest.item_dir("state"))))
        meta = json.loads((await kv.read("small/3/zarr.json")).value)
        await kv.write("small/3/zarr.json", json.dumps(meta, indent=2).encode())
        got = await ckptstore.restore(str(tmp_path), 1)
        assert got["small"]["3"].tobytes() == tree["small"]["3"].tobytes()

        info = manifest.items["state"].leaves["small/5"]
        chunk = bytearray((await kv.read(chunks.chunk_key(info))).value)
        chunk[0] ^= 0xFF
        await kv.write(chunks.chunk_key(info), bytes(chunk))
        with pytest.raises(CorruptCheckpointError, match="small/5"):
            await ckptstore.restore(str(tmp_path), 1)
    finally:
        await backend.close()


# ---- restores read chunks raw (RawLeaf), checksums checked by `chunks.checksum` ----


async def _stored_leaf(info: LeafInfo, value: np.ndarray[Any, Any]) -> ts.KvStore:
    ctx = ts.Context()
    arr = await ts.open(zarr_spec({"driver": "memory"}, info), create=True, context=ctx)
    await arr.write(value)
    return await ts.KvStore.open({"driver": "memory"}, context=ctx)


@pytest.mark.parametrize("chunk_shape", [(10, 12), (5, 4), (3, 5), (1, 12)])
async def test_raw_regions_equal_numpy_slices(chunk_shape: tuple[int, int]) -> None:
    from ckptstore.datapath.rawleaf import RawLeaf
    from ckptstore.datapath.reads import KvChunks

    value = np.arange(120, dtype=np.int32).reshape(10, 12)
    info = LeafInfo("w", (10, 12), "int32", chunk_shape, "numpy")
    leaf = await RawLeaf.open(KvChunks(await _stored_leaf(info, value)), info)
    assert leaf is not None
    rng = np.random.default_rng(1)
    regions: list[tuple[slice, ...]] = [(), (slice(None),), (slice(0, 5), slice(4, 8))]
    for _ in range(20):
        a, b = sorted(rng.integers(0, 11, 2))
        c, d = sorted(rng.integers(0, 13, 2))
        regions.append((slice(int(a), int(b)), slice(int(c), int(d))))
    for region in regions:
        got = await leaf.read(region)
        assert got.shape == value[region].shape and (got == value[region]).all(), region


async def test_raw_reads_refuse_what_they_cannot_trust() -> None:
    from ckptstore.datapath.rawleaf import RawLeaf
    from ckptstore.datapath.reads import KvChunks

    value = np.arange(120, dtype=np.float32).reshape(10, 12)
    info = LeafInfo("w", (10, 12), "float32", (5, 12), "numpy")
    kv = await _stored_leaf(info, value)
    other = LeafInfo("w", (10, 12), "float32", (10, 12), "numpy")  # not the stored grid
    assert await RawLeaf.open(KvChunks(kv), other) is None
    leaf = await RawLeaf.open(KvChunks(kv), info)
    assert leaf is not None
    await kv.write(chunks.chunk_key(info, (1, 0)), None)  # deletes the key
    assert (await leaf.read((slice(0, 5),)) == value[:5]).all()
    with pytest.raises(CorruptCheckpointError, match="w/c/1/0 is missing"):
        await leaf.read(())


async def test_zero_dimensional_leaves_keep_their_kind(tmp_path: Any) -> None:
    tree = {"arr0d": np.array(1.5, np.float16), "scalar": np.float16(2.5), "py": 3.0}
    await ckptstore.save(str(tmp_path), tree, step=1)
    got = await ckptstore.restore(str(tmp_path), 1)
    assert type(got["arr0d"]) is np.ndarray and got["arr0d"].shape == ()
    assert type(got["scalar"]) is np.float16 and got["scalar"] == 2.5
    assert type(got["py"]) is float and got["py"] == 3.0
    assert got["arr0d"].flags.writeable


async def test_verify_reads_and_counts_every_byte(tmp_path: Any) -> None:
    tree = _mixed_tree()
    tree["many"] = [np.full((1000 + i,), i, np.int16) for i in range(100)]
    await ckptstore.save(str(tmp_path), tree, step=1)
    report = await ckptstore.verify(str(tmp_path), 1)
    manifest = await ckptstore.read_manifest(str(tmp_path), 1)
    assert report.ok, report.problems
    assert report.bytes == sum(i.nbytes for i in manifest.items["state"].leaves.values())
    assert report.leaves == len(manifest.items["state"].leaves)


async def test_verify_reads_local_chunks_as_restore_does(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On local disk verify reads each chunk straight from its data file into a buffer
    (`ocdbt_index.DirectChunks`), as restore does, never through TensorStore's kvstore
    (three copies of every byte, each into fresh memory)."""
    from ckptstore.datapath.reads import KvChunks

    tree = {"big": np.arange(5 << 18, dtype=np.float32), "small": np.ones(16, np.float32)}
    await ckptstore.save(str(tmp_path), tree, step=1)

    async def refused(self: Any, keys: Any) -> Any:
        raise AssertionError(f"read through TensorStore's kvstore: {list(keys)}")

    monkeypatch.setattr(KvChunks, "get", refused)
    report = await ckptstore.verify(str(tmp_path), 1)
    assert report.ok, report.problems
    assert report.bytes == (5 << 20) + 64 and report.leaves == 2


async def test_verify_reads_within_its_budget(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify holds at most ``max_inflight_bytes`` of leaf data at once (a leaf larger
    than that alone); with room for everything it reads several leaves at once."""
    from ckptstore.checkpoint import verify as verify_module

    budgets: list[ByteBudget] = []

    class Recorded(ByteBudget):
        def __init__(self, limit: int):
            super().__init__(limit)
            budgets.append(self)

    monkeypatch.setattr(verify_module, "ByteBudget", Recorded)
    tree = {f"w{i}": np.full(64 << 10, i, np.float32) for i in range(12)}  # 256 KiB each
    await ckptstore.save(str(tmp_path), tree, step=1)
    leaf = 256 << 10
    for limit, most in ((leaf, leaf), (3 * leaf, 3 * leaf), (1 << 30, 12 * leaf)):
        report = await ckptstore.verify(str(tmp_path), 1, max_inflight_bytes=limit)
        assert report.ok and report.bytes == 12 * leaf
        assert budgets[-1].used == 0 and budgets[-1].peak <= most
    assert budgets[-1].peak > 3 * leaf  # unbounded, the workers overlap


@pytest.mark.parametrize("nbytes", [64, (4 << 20) - 4, 12 << 20])
def test_aligned_empty_gives_aligned_writable_arrays_that_cpu_devices_adopt(nbytes: int) -> None:
    """Aligned, writable, of the shape and dtype asked for, and adopted by a CPU device
    without a copy (a restore's single host copy per byte depends on it)."""
    import jax

    arr = aligned_empty((nbytes // 4,), np.dtype(np.float32))
    assert arr.shape == (nbytes // 4,) and arr.dtype == np.float32
    assert arr.flags.writeable and arr.flags.c_contiguous
    assert arr.ctypes.data % ALIGNMENT == 0
    arr[...] = np.arange(arr.size, dtype=np.float32)
    on_device = jax.device_put(arr, jax.devices()[0])
    assert on_device.unsafe_buffer_pointer() == arr.ctypes.data
    np.testing.assert_array_equal(np.asarray(on_device)[-3:], arr[-3:])
