"""Packs (`ckptstore.packs`): many small leaves in one object, on every backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from ckptstore import chunks
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import CorruptCheckpointError
from ckptstore.leaves import LeafInfo, describe_leaf
from ckptstore.packs import PackRef, read_packed, write_pack


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
    refs = await write_pack(any_backend, "item/p0/pack-0", leaves)
    assert [r.key for r in refs] == ["item/p0/pack-0"] * len(leaves)
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
    assert big.ctypes.data % chunks.ALIGNMENT == 0  # devices may adopt it without a copy


async def test_stored_bytes_are_zarr3_chunks(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "pack", leaves)
    stored = (tmp_path / "pack").read_bytes()
    size = sum(chunks.stored_size(info) for info, _ in leaves)
    assert len(stored) == size
    for (info, arr), ref in zip(leaves, refs, strict=True):
        one = stored[ref.offset : ref.offset + chunks.stored_size(info)]
        assert one == chunks.encode_chunk(info, arr)


async def test_large_pack_through_direct_io(tmp_path: Path) -> None:
    # over the 16 MiB staging buffer of local O_DIRECT writes, leaves of unaligned sizes
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in [262_147] * 20]
    leaves = leaves_of(arrays)
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "pack", leaves)
    got = await read_packed(backend, "", list(zip([i for i, _ in leaves], refs, strict=True)))
    for arr, want in zip(got, arrays, strict=True):
        np.testing.assert_array_equal(arr, want)


async def test_flipped_byte_is_corruption_naming_the_leaf(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "pack", leaves)
    raw = bytearray((tmp_path / "pack").read_bytes())
    raw[refs[3].offset + 5] ^= 0x40
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
    refs = await write_pack(backend, "pack", leaves)
    with open(tmp_path / "pack", "r+b") as f:
        f.truncate(refs[-1].offset + 10)
    with pytest.raises(CorruptCheckpointError, match=r"too short.*m/t7"):
        await read_packed(backend, "", [(leaves[-1][0], refs[-1])])


async def test_offset_that_misaligns_a_leaf_fails_its_checksum(tmp_path: Path) -> None:
    leaves = leaves_of(assorted())
    backend = LocalBackend(tmp_path)
    refs = await write_pack(backend, "pack", leaves)
    wrong = PackRef("pack", refs[1].offset + 4)
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        await read_packed(backend, "", [(leaves[1][0], wrong)])


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
def test_malformed_references_are_corruption(data: Any) -> None:
    with pytest.raises(CorruptCheckpointError) as err:
        PackRef.from_json("m/t0", data)
    assert err.value.leaf == "m/t0"


def test_reference_json_roundtrip() -> None:
    ref = PackRef("p0/pack-3", 123_456)
    assert PackRef.from_json("x", ref.to_json()) == ref
