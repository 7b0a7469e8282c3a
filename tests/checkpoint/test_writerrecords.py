"""What a process records beside its store (`ckptstore.checkpoint.writerrecords`): the other
processes write it for process 0, process 0 keeps its own in memory, and `collect` joins
both as if all had been read."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ckptstore
from ckptstore.backends.memory import MemoryBackend
from ckptstore.checkpoint.chunklevel import RECORDS
from ckptstore.checkpoint.incremental import DIGESTS
from ckptstore.checkpoint.writerrecords import Beside, collect, record
from ckptstore.datapath.chunkwrites import ChunkPlan
from ckptstore.datapath.packs import INDEX, read_index
from ckptstore.format import layout
from ckptstore.format.packs import PackRef

A, B = "a" * 32, "b" * 32


def beside(first: int) -> Beside:
    """One writer's records of leaf "t": two pieces, chunks ``first`` and ``first + 1``
    (the second held by the base), and a leaf "u" without chunk digests."""
    return Beside(
        {"t": {f"{first}:{first + 1}": A}, "u": {}},
        ChunkPlan(held={"t": {first + 1}}, digests={"t": {first: A, first + 1: B}, "u": {}}),
    )


async def test_process_0_keeps_its_records_and_the_others_write_theirs() -> None:
    async with MemoryBackend() as b:
        assert await record(b, "s0", beside(0), keep=True) == (1, 1)
        assert [n async for n in b.list("s0")] == []  # nothing written for process 0
        assert await record(b, "s1", beside(2), keep=False) == (1, 1)
        assert {n.key async for n in b.list("s1")} == {f"s1/{DIGESTS}", f"s1/{RECORDS}"}
        tables, records = await collect(b, ["s1"], ["s1"], beside(0))
    assert tables == {"t": {"0:1": A, "2:3": A}}
    assert records.digests == {"t": {0: A, 1: B, 2: A, 3: B}}
    assert records.held == {"t": {1, 3}}


async def test_process_0_keeps_its_pack_index_and_the_others_write_theirs() -> None:
    packed = {"b": PackRef("pack-0", 0), "c": PackRef("pack-0", 512)}
    async with MemoryBackend() as b:
        assert await record(b, "s0", Beside(None, ChunkPlan(), packed), keep=True) == (0, 0)
        assert [n async for n in b.list("s0")] == []
        assert await record(b, "s1", Beside(None, ChunkPlan(), packed), keep=False) == (0, 0)
        assert {n.key async for n in b.list("s1")} == {f"s1/{INDEX}"}  # no chunk records
        assert await read_index(b, "s1") == packed


async def test_without_digests_only_the_chunk_records_are_written() -> None:
    async with MemoryBackend() as b:
        plan = ChunkPlan(digests={"t": {0: A}})
        assert await record(b, "s1", Beside(None, plan), keep=False) == (0, 1)
        assert {n.key async for n in b.list("s1")} == {f"s1/{RECORDS}"}
        tables, records = await collect(b, [], ["s1"], None)
    assert tables == {} and records.digests == {"t": {0: A}} and records.held == {"t": set()}


def test_a_one_process_chunk_level_save_writes_no_records_beside_its_store(tmp_path: Path) -> None:
    values = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    root = str(tmp_path / "ckpt")
    bias = np.ones(8, np.float32)  # a small leaf: packed
    first = ckptstore.save_sync(root, {"t": values, "b": bias}, step=1, chunk_bytes=1024)
    values[0, 0] = -1.0
    second = ckptstore.save_sync(
        root, {"t": values, "b": bias * 2}, step=2, base=first, chunk_bytes=1024
    )
    store = tmp_path / "ckpt" / layout.AttemptDir(2, second.attempt).process_store("state", 0)
    assert store.is_dir() and not (store / DIGESTS).exists() and not (store / RECORDS).exists()
    assert not (store / INDEX).exists()  # the bias below was packed: process 0 kept its index
    manifest = ckptstore.read_manifest_sync(root, 2).items["state"]
    assert manifest.digests["t"] and manifest.chunk_digests["t"] and manifest.chunk_refs["t"]
    assert "b" in manifest.packed
    restored = ckptstore.restore_sync(root, 2)
    np.testing.assert_array_equal(restored["t"], values)
    np.testing.assert_array_equal(restored["b"], bias * 2)
