"""Packs (`ckptstore.format.packs`, written and read by `ckptstore.datapath.packs`): many small
leaves in one object, on every backend."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.datapath.packs import check_packs, read_index, read_packed, write_index, write_pack
from ckptstore.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckptstore.format import chunks
from ckptstore.format.leaves import LeafInfo, describe_leaf
from ckptstore.format.packs import PackRef, entry_size
from ckptstore.runtime.hostpool import ALIGNMENT


def leaves_of(arrays: list[np.ndarray[Any, Any]]) -> list[tuple[LeafInfo, np.ndarray[Any, Any]]]:
    return [(describe_leaf(f"m/t{i}", a), a) for i, a in enumerate(arrays)]


def assorted() -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((3, 5)).astype(np.float32),
        np.arange(7, dtype=np.int64),
        np.asarray(2.5, np.float64),  # a scalar
        rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16),
        np.array([True, False, True]),
        rng.standard_normal(9).astype(">f4"),  # big-endian: stored little-endian
        np.asfortranarray(rng.standard_normal((6, 3))),  # not C-contiguous
        rng.standard_normal((257, 1031)).astype(np.float32),  # ~1 MiB, unaligned size
    ]


async def test_roundtrip_on_every_backend(any_backend: Backend) -> None:
    leaves = leaves_of(assorted())
    refs = await write_pack(any_backend, "item", "p0/pack-0", leaves)
    assert [r.key for r in refs] == ["p0/pack-0"] * len(leaves)
    assert refs[0].offset == 0 and sorted(r.offset for r in refs) == [r.offset for r in refs]
    # read back in another order, from the item's directory, some twice
    order = [7, 2, 0, 5, 3, 1, 6, 4, 2]
    wanted = [
        (leaves[i][0], PackRef(refs[i].key.removeprefix("item/"), refs[i].offset)) for i in order
    ]
    got = await read_packed(any_backend, "item", wanted)
    for i, arr in zip(order, got, strict=True):
        want = leaves[i][1]
        assert arr.dtype == want.dtype.newbyteorder("=") or arr.dtype == want.dtype
        assert arr.shape == want.shape
        np.testing.assert_array_equal(arr, want)
    big = got[0]
    assert big.ctypes.data % ALIGNMENT == 0  # devices may adopt it without a copy


async def test_each_entry_is_the_leafs_zarr_json_then_its_zarr3_chunk(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    stored = (tmp_path / "pack").read_bytes()
    assert len(stored) == sum(entry_size(info) for info, _ in leaves)
    for (info, arr), ref in zip(leaves, refs, strict=True):
        meta = chunks.encode_metadata(info)
        at = ref.offset + len(meta)
        assert stored[ref.offset : at] == meta
        assert stored[at : ref.offset + entry_size(info)] == chunks.encode_chunk(info, arr)


async def test_a_record_disagreeing_with_the_stored_zarr_json_is_corruption(
    tmp_path: Path,
) -> None:
    # float32 (3, 5) recorded as int32 (3, 5): same size, same checksum; caught by zarr.json
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    edited = dataclasses.replace(leaves[0][0], dtype="int32")
    with pytest.raises(CorruptCheckpointError, match="manifest says data_type 'int32'") as err:
        await read_packed(backend, "", [(edited, refs[0])])
    assert err.value.leaf == "m/t0"
    # same dtype, another shape of as many digits: the stored document is read whole
    reshaped = dataclasses.replace(leaves[0][0], shape=(5, 3), chunk_shape=(5, 3))
    with pytest.raises(CorruptCheckpointError, match=r"says data_type 'float32', shape \[3, 5\]"):
        await read_packed(backend, "", [(reshaped, refs[0])])


async def test_large_pack_through_direct_io(tmp_path: Path) -> None:
    # over the 16 MiB staging buffer of local O_DIRECT writes, leaves of unaligned sizes
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in [262_147] * 20]
    leaves = leaves_of(arrays)
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    got = await read_packed(backend, "", list(zip([i for i, _ in leaves], refs, strict=True)))
    for arr, want in zip(got, arrays, strict=True):
        np.testing.assert_array_equal(arr, want)


async def test_flipped_byte_is_corruption_naming_the_leaf(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    raw = bytearray((tmp_path / "pack").read_bytes())
    raw[refs[3].offset + len(chunks.encode_metadata(leaves[3][0])) + 5] ^= 0x40
    (tmp_path / "pack").write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="crc32c") as err:
        await read_packed(backend, "", list(zip([i for i, _ in leaves], refs, strict=True)))
    assert err.value.leaf == "m/t3"
    # the other leaves still read
    ok = [(leaves[i][0], refs[i]) for i in (0, 1, 2, 4)]
    assert len(await read_packed(backend, "", ok)) == 4


async def test_truncated_pack_is_corruption(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    with open(tmp_path / "pack", "r+b") as f:
        f.truncate(refs[-1].offset + 10)
    with pytest.raises(CorruptCheckpointError, match=r"pack too short") as err:
        await read_packed(backend, "", list(zip([i for i, _ in leaves], refs, strict=True)))
    assert err.value.leaf == "m/t7"  # the one leaf cut off, found among the eight read at once


async def test_a_missing_pack_is_corruption(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    (tmp_path / "pack").unlink()
    with pytest.raises(CorruptCheckpointError, match="pack pack of m/t2 is missing"):
        await read_packed(backend, "", [(leaves[2][0], refs[2])])


async def test_an_offset_that_misses_the_leaf_is_corruption(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    wrong = PackRef("pack", refs[1].offset + 4)
    with pytest.raises(CorruptCheckpointError, match="does not match its record"):
        await read_packed(backend, "", [(leaves[1][0], wrong)])


async def test_a_codec_renamed_in_a_stored_zarr_json_is_named(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "", "pack", leaves)
    raw = (tmp_path / "pack").read_bytes()
    at = raw.index(b'"crc32c"', refs[1].offset)  # leaf 1's zarr.json, same length after
    (tmp_path / "pack").write_bytes(raw[:at] + b'"crc64x"' + raw[at + 8 :])
    with pytest.raises(CorruptCheckpointError, match=r"names codecs \[.*'crc64x'.*implies") as err:
        await read_packed(backend, "", [(leaves[1][0], refs[1])])
    assert "crc32c" in str(err.value) and err.value.leaf == leaves[1][0].name


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"key": "pack"},
        {"key": "pack", "offset": -1},
        {"key": "pack", "offset": 1.5},
        {"key": "pack", "offset": True},
        {"key": 3, "offset": 0},
        {"key": "../outside", "offset": 0},
        {"key": "/abs", "offset": 0},
    ],
)
def test_malformed_references_are_refused_naming_the_leaf(data: Any) -> None:
    with pytest.raises(ValueError, match="m/t0"):
        PackRef.from_json("m/t0", data)


def test_a_bad_pack_key_is_refused_every_time_a_good_one_is_checked() -> None:
    """Pack keys are validated once each (a manifest repeats them thousands of times): a
    refusal is never remembered as a pass, and a key refused once is refused again."""
    for _ in range(3):
        with pytest.raises(ValueError, match="bad pack key"):
            PackRef.from_json("m/t0", {"key": "p0/../../x", "offset": 0})
    assert PackRef.from_json("m/t1", {"key": "p0/pack-1", "offset": 8}).key == "p0/pack-1"
    with pytest.raises(ValueError, match="bad pack key"):
        PackRef.from_json("m/t2", {"key": "p0/../../x", "offset": 0})


def test_reference_json_roundtrip() -> None:
    ref = PackRef("p0/pack-3", 123_456)
    assert PackRef.from_json("x", ref.to_json()) == ref


async def test_check_packs_names_leaves_of_missing_and_short_packs(any_backend: Backend) -> None:
    leaves = leaves_of(assorted())
    first = await write_pack(any_backend, "item", "p0/pack-0", leaves[:4])
    second = await write_pack(any_backend, "item", "p1/pack-0", leaves[4:])
    refs = list(zip([i for i, _ in leaves], first + second, strict=True))
    await check_packs(any_backend, "item", refs)  # all there
    await any_backend.write("item/p1/pack-0", b"\0" * second[-1].offset)  # cut short
    missing = (leaves[0][0], PackRef("p0/pack-9", 0))
    with pytest.raises(IncompleteCheckpointError) as err:
        await check_packs(any_backend, "item", [*refs, missing])
    assert set(err.value.leaves) == {"m/t0", "m/t7"}
    assert "missing" in err.value.leaves["m/t0"] and "bytes" in err.value.leaves["m/t7"]


# ---- packs in a save ----


def mixed_tree() -> dict[str, Any]:
    rng = np.random.default_rng(2)
    return {
        "big": rng.standard_normal((1024, 1280)).astype(np.float32),  # 5 MiB: TensorStore's
        "small": [rng.standard_normal(n).astype(np.float32) for n in (1, 100, 5000)],
        "bf16": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16),
        "step": 7,
    }


async def test_a_save_packs_its_small_leaves(any_backend: Backend) -> None:
    tree = mixed_tree()
    await ckptstore.save(any_backend, tree, step=1)
    item = (await ckptstore.read_manifest(any_backend, 1)).items["state"]
    assert set(item.packed) == {"small/0", "small/1", "small/2", "bf16", "step"}
    assert {ref.key for ref in item.packed.values()} == {"ocdbt.process_0/pack-0"}
    got = await ckptstore.restore(any_backend, 1)
    np.testing.assert_array_equal(got["big"], tree["big"])
    for a, b in zip(got["small"], tree["small"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got["bf16"].dtype == tree["bf16"].dtype and got["step"] == 7
    report = await ckptstore.verify(any_backend, 1)
    assert report.ok and report.leaves == 6
    assert report.bytes == sum(info.nbytes for info in item.leaves.values())


async def test_a_saves_packs_are_encoded_one_at_a_time_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding packs all at once would make the first ready only when the last is (they
    share the interpreter lock and the cores); one at a time, in order, the first pack is
    written while the next is encoded."""
    import threading
    import time

    from ckptstore.datapath import packs

    running, most, order = [0], [0], []
    lock = threading.Lock()
    real = packs.pack_parts

    def pack_parts(leaves: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            order.append(leaves[0][0].name)
        time.sleep(0.02)  # long enough for an unserialized encode to start meanwhile
        try:
            return real(leaves)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(packs, "pack_parts", pack_parts)
    tree = {f"t{i:04d}": np.full(4, i, np.float32) for i in range(1200)}  # 512 a group: 3
    await ckptstore.save(LocalBackend(tmp_path), tree, step=1)
    assert most[0] == 1 and order == ["t0000", "t0512", "t1024"], (most, order)
    got = await ckptstore.restore(LocalBackend(tmp_path), 1)
    np.testing.assert_array_equal(got["t1100"], tree["t1100"])


async def test_packed_leaves_restore_onto_shardings(tmp_path: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
    tree = {"w": jax.device_put(np.arange(64.0).reshape(8, 8), spec)}
    await ckptstore.save(str(tmp_path), tree, step=1)  # 4 shards of 128 B: not one chunk
    assert (await ckptstore.read_manifest(str(tmp_path), 1)).items["state"].packed == {}
    small = {"v": np.arange(16.0).reshape(4, 4)}
    await ckptstore.save(str(tmp_path), small, step=2)
    like = {"v": jax.ShapeDtypeStruct((4, 4), np.float64, sharding=spec)}
    got = await ckptstore.restore(str(tmp_path), 2, like=like)
    assert got["v"].sharding == spec
    np.testing.assert_array_equal(np.asarray(got["v"]), small["v"])


async def test_verify_and_restore_name_a_damaged_packed_leaf(tmp_path: Path) -> None:
    tree = mixed_tree()
    await ckptstore.save(str(tmp_path), tree, step=1)
    item = (await ckptstore.read_manifest(str(tmp_path), 1)).items["state"]
    ref, info = item.packed["small/2"], item.leaves["small/2"]
    (pack,) = tmp_path.rglob("pack-0")
    raw = bytearray(pack.read_bytes())
    raw[ref.offset + len(chunks.encode_metadata(info)) + 100] ^= 1
    pack.write_bytes(bytes(raw))
    report = await ckptstore.verify(str(tmp_path), 1)
    assert (
        list(report.problems) == ["state/small/2"] and "crc32c" in report.problems["state/small/2"]
    )
    with pytest.raises(CorruptCheckpointError) as err:
        await ckptstore.restore(str(tmp_path), 1)
    assert err.value.leaf == "small/2"
    pack.unlink()
    report = await ckptstore.verify(str(tmp_path), 1)
    assert set(report.problems) == {f"state/{n}" for n in item.packed} and not report.unreadable


async def test_index_roundtrip_and_a_malformed_one_is_corruption(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    refs = {"a/b": PackRef("ocdbt.process_1/pack-0", 0), "c": PackRef("ocdbt.process_1/pack-2", 9)}
    await write_index(backend, "item/ocdbt.process_1", refs)
    assert await read_index(backend, "item/ocdbt.process_1") == refs
    for bad in (b"[1]", b"{not json", b'{"a": {"key": "../x", "offset": 0}}'):
        (tmp_path / "item" / "ocdbt.process_1" / "packs.json").write_bytes(bad)
        with pytest.raises(CorruptCheckpointError, match="unreadable pack index"):
            await read_index(backend, "item/ocdbt.process_1")


async def test_the_primary_gathers_every_writers_index(tmp_path: Path) -> None:
    """Process 0 reads the index of each other process that reports packed leaves (several
    writers: the coordination service carries counts, not tables) and takes its own from
    memory (it wrote none)."""
    from ckptstore.checkpoint.save import ProcessReport
    from ckptstore.checkpoint.saveplan import packed_leaves
    from ckptstore.checkpoint.writerrecords import Beside
    from ckptstore.datapath.chunkwrites import ChunkPlan
    from ckptstore.format import layout

    backend = LocalBackend(tmp_path)
    where = layout.AttemptDir(1, layout.new_attempt())
    infos = [info for info, _ in leaves_of(assorted())[:3]]
    kept = Beside(None, ChunkPlan(), {"m/t2": PackRef("a/pack-0", 0)})
    await write_index(backend, where.process_store("state", 2), {"m/t0": PackRef("b/pack-0", 8)})
    reports = [ProcessReport(i, packed={"state": n}) for i, n in enumerate((1, 0, 1))]
    got = await packed_leaves(backend, where, "state", infos, reports, kept)
    assert list(got.items()) == [("m/t0", PackRef("b/pack-0", 8)), ("m/t2", PackRef("a/pack-0", 0))]
    await write_index(backend, where.process_store("state", 1), {"m/t0": PackRef("c/pack-0", 0)})
    reports[1] = ProcessReport(1, packed={"state": 1})
    with pytest.raises(ckptstore.CkptStoreError, match="packed by two processes"):
        await packed_leaves(backend, where, "state", infos, reports, kept)
    await write_index(backend, where.process_store("state", 1), {"other": PackRef("c/pack-0", 0)})
    with pytest.raises(ckptstore.CkptStoreError, match="the tree does not have"):
        await packed_leaves(backend, where, "state", infos, reports, kept)


@pytest.mark.parametrize("after", [False, True])
async def test_a_failed_pack_write_commits_nothing_and_the_step_saves_again(
    tmp_path: Path, after: bool
) -> None:
    """The second pack's write fails (before it landed, or after: a lost reply): the save
    raises a typed error, the earlier step is intact, and a retry commits."""
    from ckptstore.testing.faults import FaultyBackend

    small = {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(40)}  # 160 MiB: 3 packs
    await ckptstore.save(str(tmp_path), {"x": np.arange(3)}, step=1)
    faulty = FaultyBackend(
        LocalBackend(tmp_path), ops={"write"}, fail_on=[2], error="permanent", after=after
    )
    with pytest.raises(ckptstore.StorageError, match="injected permanent fault"):
        await ckptstore.save(faulty, small, step=2)
    assert await ckptstore.list_steps(str(tmp_path)) == [1]
    assert (await ckptstore.verify(str(tmp_path), 1)).ok
    await ckptstore.save(str(tmp_path), small, step=2)
    got = await ckptstore.restore(str(tmp_path), 2)
    assert all((got[k] == v).all() for k, v in small.items())


async def test_a_full_disk_while_packing_is_typed_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills mid-pack (ENOSPC from the kernel's write): a StorageError naming the
    pack, no temporary file left, the earlier step intact and the step savable afterwards."""
    import errno
    import os

    import ckptstore.backends.local as local

    await ckptstore.save(str(tmp_path), {"x": np.arange(3)}, step=1)
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        if "pack-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(local.os, "write", full)
    tree = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(8)}
    with pytest.raises(ckptstore.StorageError, match=r"No space left on device.*pack-0"):
        await ckptstore.save(str(tmp_path), tree, step=2)
    monkeypatch.setattr(local.os, "write", real_write)
    assert await ckptstore.list_steps(str(tmp_path)) == [1]
    assert not [p for p in tmp_path.rglob("*") if ".ckptstore-tmp" in p.name]
    assert (await ckptstore.verify(str(tmp_path), 1)).ok
    await ckptstore.save(str(tmp_path), tree, step=2)
    assert (await ckptstore.restore(str(tmp_path), 2))["w7"][0] == 7
