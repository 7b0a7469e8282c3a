"""Chunk-level incremental saves: a leaf that changed in a few chunks writes only those,
references the rest to the attempts holding them (no chains), and restores, verifies,
survives the deletion of its base and gc (docs/incremental.md, "Chunk references")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.manifest import Reference
from ckptstore.protocol import load_committed
from tests.checkpoint.helpers import assert_same, resign, stored_bytes
from tests.conftest import make_backend
from tests.paths import committed_root

ROWS, COLS = 1024, 64  # float32: 256 KiB
CHUNK = 4096  # bytes: chunks of 32 x 32 (the largest dimension halved first): 64 chunks
CHUNK_ROWS = 32


@pytest.fixture(params=["local", "memory", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b = await make_backend(request.param, request, tmp_path)
    async with b:
        yield b


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[Backend]:
    b = LocalBackend(tmp_path / "ckpt")
    async with b:
        yield b


def table(seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((ROWS, COLS), dtype=np.float32)


def changed(values: np.ndarray[Any, Any], *rows: int) -> np.ndarray[Any, Any]:
    """``values`` with the given rows changed (each row touches the 2 chunks across it)."""
    out = values.copy()
    for row in rows:
        out[row] += 1.0
    return out


async def save(backend: Backend, emb: Any, step: int, base: int | None = None) -> Any:
    tree = {"emb": emb, "bias": np.arange(8, dtype=np.float32) + step, "frozen": FROZEN}
    return await ckptstore.save(backend, tree, step=step, base=base, chunk_bytes=CHUNK)


FROZEN = np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8)


async def test_only_changed_chunks_are_written_and_restore_bit_exact(backend: Backend) -> None:
    first = table()
    full = await save(backend, first, 1)
    assert full.bytes_written == full.bytes
    later = changed(first, 3, 700)  # chunk rows 0 and 21: 4 chunks of 64
    inc = await save(backend, later, 2, base=1)
    chunk_bytes = CHUNK_ROWS * 32 * 4
    assert inc.bytes_written == 4 * chunk_bytes + 32  # and the bias, which changed whole
    assert inc.bytes_referenced == later.nbytes - 4 * chunk_bytes + FROZEN.nbytes
    # On storage: the 4 chunks, the bias, metadata; far from the table's 256 KiB.
    assert await stored_bytes(backend, 2) < 4 * chunk_bytes + (40 << 10)

    manifest = await load_committed(backend, 2)
    item = manifest.items["state"]
    assert manifest.format_version == layout.FORMAT_VERSION == 5
    assert set(item.chunk_refs) == {"emb"} and set(item.refs) == {"frozen"}
    one = Reference(1, str((await load_committed(backend, 1)).attempt))
    assert manifest.references == [one] and manifest.base == one
    assert item.chunk_refs["emb"].to_json() == {"0": [[2, 42], [44, 64]]}
    assert item.held_chunk_bytes("emb") == 60 * chunk_bytes
    got = await ckptstore.restore(backend, 2)
    assert_same(got, {"bias": np.arange(8, dtype=np.float32) + 2, "emb": later, "frozen": FROZEN})
    assert_same((await ckptstore.restore(backend, 1))["emb"], first)
    assert (await ckptstore.verify(backend, 2)).ok


async def test_all_chunks_changed_is_written_whole_and_none_is_a_leaf_reference(
    local: Backend,
) -> None:
    await save(local, table(), 1)
    await save(local, table(1), 2, base=1)  # every chunk differs
    item = (await load_committed(local, 2)).items["state"]
    assert not item.chunk_refs and "emb" not in item.refs
    await save(local, table(1), 3, base=2)  # nothing differs: a reference to the leaf
    item = (await load_committed(local, 3)).items["state"]
    assert not item.chunk_refs and "emb" in item.refs
    assert_same((await ckptstore.restore(local, 3))["emb"], table(1))


async def test_a_chain_of_three_names_each_chunks_original_writer(local: Backend) -> None:
    v1 = table()
    v2 = changed(v1, 3)  # chunks 0, 1
    v3 = changed(v2, 700)  # chunks 42, 43
    await save(local, v1, 1)
    await save(local, v2, 2, base=1)
    third = await save(local, v3, 3, base=2)
    assert third.bytes_written == 2 * CHUNK + 32
    manifest = await load_committed(local, 3)
    refs = manifest.items["state"].chunk_refs["emb"]
    who = {k: manifest.references[k].step for k in refs.held}
    held = {who[k]: ranges for k, ranges in refs.held.items()}
    # Chunks 0-1 were written by step 2; all the others (but 42-43, written now) by step 1.
    assert held == {2: ((0, 2),), 1: ((2, 42), (44, 64))}
    assert {r.step for r in manifest.references} == {1, 2}
    assert manifest.base == Reference(2, str((await load_committed(local, 2)).attempt))
    assert_same((await ckptstore.restore(local, 3))["emb"], v3)


async def test_base_deleted_then_gc_keeps_every_chunk_holder(local: Backend) -> None:
    v1 = table()
    v2, v3 = changed(v1, 3), changed(v1, 3, 700)
    for step, (value, base) in enumerate([(v1, None), (v2, 1), (v3, 2)], start=1):
        await save(local, value, step, base=base)
    await ckptstore.delete_step(local, 1)
    await ckptstore.delete_step(local, 2)
    await ckptstore.gc(local, older_than=0)
    assert await ckptstore.list_steps(local) == [3]
    assert_same((await ckptstore.restore(local, 3))["emb"], v3)
    assert (await ckptstore.verify(local, 3)).ok
    await ckptstore.delete_step(local, 3)  # the last referrer: everything goes
    removed = await ckptstore.gc(local, older_than=0)
    assert len(removed.entries) >= 2


async def test_verify_and_restore_catch_a_corrupted_referenced_chunk(local: Backend) -> None:
    await save(local, table(), 1)
    await save(local, changed(table(), 3), 2, base=1)
    base_root = await committed_root(local, 1)
    files = [o async for o in local.list(base_root) if "/ocdbt.process_0/d/" in o.key]
    biggest = max(files, key=lambda o: o.size)
    data = bytearray(await local.read(biggest.key))
    data[len(data) // 2] ^= 0x01
    await local.write(biggest.key, bytes(data))
    report = await ckptstore.verify(local, 2)
    assert not report.ok
    assert any(k.endswith("emb") or k.endswith("frozen") for k in report.problems), report
    with pytest.raises(CorruptCheckpointError):
        await ckptstore.restore(local, 2)


async def test_a_chunk_its_holder_lacks_is_an_error_never_zeros(local: Backend) -> None:
    """A manifest naming a holder without the chunks (forged, marker re-signed): restore
    refuses it (the holder's manifest does not have them), verify reports the missing
    chunk; no fill value is ever read."""
    await ckptstore.save(local, {"x": np.zeros(3, np.float32)}, step=0)
    await save(local, table(), 1)
    await save(local, changed(table(), 3), 2, base=1)
    root = await committed_root(local, 2)
    doc = json.loads(await local.read(f"{root}/manifest.json"))
    zero = await committed_root(local, 0)
    doc["references"].append({"step": 0, "attempt": zero.split("/")[1]})
    doc["items"]["state"]["chunk_refs"]["emb"] = {"1": [[2, 64]]}
    await resign(local, 2, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="recorded no digest for it"):
        await ckptstore.restore(local, 2)  # the holder's manifest says so before a read
    assert not (await ckptstore.verify(local, 2)).ok


async def test_verify_compares_referenced_chunks_with_their_digests(local: Backend) -> None:
    """A forged manifest pointing chunks at other bytes that are intact (crc32c passes):
    only the recorded chunk digests tell; verify does."""
    await save(local, table(), 1)
    await save(local, changed(table(), 3), 2, base=1)
    await save(local, changed(table(), 3, 700), 3, base=2)
    root = await committed_root(local, 3)
    doc = json.loads(await local.read(f"{root}/manifest.json"))
    refs = doc["items"]["state"]["chunk_refs"]["emb"]
    # Every held chunk read from step 1 (which has chunks 0-1 as they were before step 2).
    doc["items"]["state"]["chunk_refs"]["emb"] = {
        str(k): [[0, 42], [44, 64]]
        for k, r in enumerate(doc["references"])
        if r["step"] == 1 and str(k) in refs
    }
    await resign(local, 3, json.dumps(doc).encode())
    report = await ckptstore.verify(local, 3)
    assert not report.ok
    assert any("chunk 0" in why for why in report.problems.values()), report.problems


def _mesh(shape: tuple[int, int], names: tuple[str, str]) -> Mesh:
    if len(jax.devices()) < 8:
        pytest.fail(f"need 8 CPU devices (XLA_FLAGS), have {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


async def test_sharded_partial_and_resharded_restores(local: Backend) -> None:
    """Sharded over 8 devices, each process decides for its shards' chunks; the step
    restores partially, and onto another mesh, bit-exact."""
    m = _mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(m, P("x", "y"))
    first = table()
    await save(local, jax.device_put(first, sharding), 1)
    later = changed(first, 3, 700)
    inc = await save(local, jax.device_put(later, sharding), 2, base=1)
    assert inc.bytes_written == 4 * CHUNK + 32
    assert (await load_committed(local, 2)).items["state"].chunk_refs

    other = NamedSharding(_mesh((2, 4), ("a", "b")), P("b", "a"))
    like = {"emb": jax.ShapeDtypeStruct(later.shape, later.dtype, sharding=other)}
    got = await ckptstore.restore(local, 2, like, partial=True)
    assert got["emb"].sharding == other
    np.testing.assert_array_equal(np.asarray(got["emb"]), later)
    whole = await ckptstore.restore(local, 2)
    np.testing.assert_array_equal(whole["emb"], later)
    assert (await ckptstore.verify(local, 2)).ok


async def test_promotion_and_orbax_export_of_a_chunk_referencing_step(
    tmp_path: Path, local: Backend
) -> None:
    tiers = ckptstore.Tiered(str(tmp_path / "ckpt"), str(tmp_path / "durable"))
    v2 = changed(table(), 3)
    await save(local, table(), 1)
    await save(local, v2, 2, base=1)
    await ckptstore.promote(tiers, step=2)
    durable = str(tmp_path / "durable")
    assert_same((await ckptstore.restore(durable, 2))["emb"], v2)
    assert (await ckptstore.verify(durable, 2)).ok
    # Orbax reads the leaf whole from the export: its chunks, wherever they are held, written
    # into the view.
    exported = await ckptstore.export_orbax(local, str(tmp_path / "orbax"), step=2)
    import orbax.checkpoint as ocp

    got = await asyncio.to_thread(ocp.StandardCheckpointer().restore, exported.path)
    np.testing.assert_array_equal(np.asarray(got["emb"]), v2)
    np.testing.assert_array_equal(np.asarray(got["frozen"]), FROZEN)


async def test_a_leaf_its_base_held_in_part_and_now_unchanged_is_held_chunk_by_chunk(
    local: Backend,
) -> None:
    """Unchanged since a base that held it in part, the leaf is not written at all (its
    zarr.json neither): every chunk names its original writer, and it restores after both
    earlier steps are deleted and gc runs. A partial save on that base (parts reference
    leaves whole) writes it whole."""
    v2 = changed(table(), 3)
    await save(local, table(), 1)
    await save(local, v2, 2, base=1)
    third = await save(local, v2, 3, base=2)
    assert third.bytes_written == 32  # the bias alone
    manifest = await load_committed(local, 3)
    refs = manifest.items["state"].chunk_refs["emb"]
    held = {manifest.references[k].step: ranges for k, ranges in refs.held.items()}
    assert held == {2: ((0, 2),), 1: ((2, 64),)} and refs.count == 64
    assert "emb" not in manifest.items["state"].refs
    assert_same((await ckptstore.restore(local, 3))["emb"], v2)
    assert (await ckptstore.verify(local, 3)).ok

    session = await ckptstore.partial_save(local, step=4, base=2)
    part = await session.add({"emb": v2})
    assert not part.refs  # written whole: a part cannot reference chunks
    await session.finalize()
    assert_same((await ckptstore.restore(local, 4))["emb"], v2)

    for step in (1, 2):
        await ckptstore.delete_step(local, step)
    await ckptstore.gc(local, older_than=0)
    assert_same((await ckptstore.restore(local, 3))["emb"], v2)
    assert (await ckptstore.verify(local, 3)).ok


async def test_compressed_leaves_are_written_in_part_too(local: Backend, tmp_path: Path) -> None:
    """A leaf compressed with zstd (docs/codecs.md) in the base and now: only its changed
    chunks are written, its held chunks are read (decoded) from the base's store, and
    verify, an Orbax export and a restore after the base is deleted and gc all agree."""
    first = table()
    zstd = {"emb": "zstd:1"}
    tree = {"emb": first, "frozen": FROZEN}
    await ckptstore.save(local, tree, step=1, chunk_bytes=CHUNK, codecs=zstd)
    later = changed(first, 3, 700)
    result = await ckptstore.save(
        local, {**tree, "emb": later}, step=2, base=1, chunk_bytes=CHUNK, codecs=zstd
    )
    assert result.bytes_written == 4 * CHUNK_ROWS * 32 * 4  # the 4 changed chunks
    manifest = await load_committed(local, 2)
    assert "emb" in manifest.items["state"].chunk_refs
    assert manifest.items["state"].leaves["emb"].codec is not None
    assert manifest.format_version == 5
    assert (await ckptstore.verify(local, 2)).ok
    exported = await ckptstore.export_orbax(local, str(tmp_path / "orbax"), step=2)
    import orbax.checkpoint as ocp

    got = await asyncio.to_thread(ocp.StandardCheckpointer().restore, exported.path)
    np.testing.assert_array_equal(np.asarray(got["emb"]), later)
    await ckptstore.delete_step(local, 1)
    await ckptstore.gc(local, older_than=0)
    assert_same(await ckptstore.restore(local, 2), {"emb": later, "frozen": FROZEN})
    written = await ckptstore.save(
        local, {**tree, "emb": later}, step=3, base=2, chunk_bytes=CHUNK, codecs=None
    )
    assert written.bytes_written >= later.nbytes  # another codec: the leaf is written whole


@pytest.mark.parametrize(
    ("digests", "named"),
    [
        ({"0": "a" * 32, "1": "A" * 32}, "'1'"),
        ({"0": "a" * 32, "x": "b" * 32}, "'x'"),
        ({"0": "a" * 31}, "'0'"),
        ({"0": 5}, "'0'"),
    ],
)
async def test_a_bad_chunk_record_is_an_error_naming_the_chunk(
    tmp_path: Path, digests: dict[str, Any], named: str
) -> None:
    from ckptstore.checkpoint.chunklevel import RECORDS, read_records
    from ckptstore.errors import CkptStoreError

    async with LocalBackend(str(tmp_path)) as b:
        good = {"0": "a" * 32, "1": "b" * 32}
        await b.write(f"s0/{RECORDS}", json.dumps({"t": {"digests": good, "held": [1]}}).encode())
        records = await read_records(b, ["s0"])
        assert records.digests == {"t": {0: "a" * 32, 1: "b" * 32}} and records.held == {"t": {1}}
        await b.write(f"s1/{RECORDS}", json.dumps({"t": {"digests": digests, "held": []}}).encode())
        with pytest.raises(CkptStoreError, match=f"s1/{RECORDS}.*bad chunk digest {named}"):
            await read_records(b, ["s0", "s1"])


async def test_chunks_written_in_part_are_read_back_by_plain_tensorstore(
    tmp_path: Path,
) -> None:
    """Chunks written in part go as raw OCDBT keys (no TensorStore open), encoded as zarr3
    stores them, so TensorStore itself reads the written chunks of the step's own store,
    and ckptstore restores the whole leaf. (Edge chunks: tests/datapath.)"""
    import tensorstore as ts

    root = tmp_path / "ckpt"
    rng = np.random.default_rng(3)
    first = rng.standard_normal((1000, 70), dtype=np.float32)  # chunks of 25 x 35
    await ckptstore.save(str(root), {"t": first}, step=1, chunk_bytes=4096)
    later = first.copy()
    later[999, 69] += 1.0  # the last chunk
    later[30, 40] -= 1.0  # and one inside
    got = await ckptstore.save(str(root), {"t": later}, step=2, base=1, chunk_bytes=4096)
    assert got.bytes_written == 2 * 25 * 35 * 4
    manifest = ckptstore.read_manifest_sync(str(root), 2)
    assert "t" in manifest.items["state"].chunk_refs
    arr = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {
                "driver": "ocdbt",
                "base": f"file://{root}/2/{manifest.attempt}/state/",
                "path": "t/",
            },
        }
    ).result()
    np.testing.assert_array_equal(arr[975:1000, 35:70].read().result(), later[975:1000, 35:70])
    np.testing.assert_array_equal(arr[25:50, 35:70].read().result(), later[25:50, 35:70])
    assert_same((await ckptstore.restore(str(root), 2))["t"], later)
    assert (await ckptstore.verify(str(root), 2)).ok


def test_held_chunks_are_those_whose_digest_is_the_bases() -> None:
    """`held_chunks` compares every digest at once; a chunk the base's record does not
    reach (a longer table than the record) is never held."""
    from ckptstore.checkpoint.chunklevel import held_chunks

    recorded = "".join(f"{k:032x}" for k in range(8))
    mine = {k: f"{k:032x}" for k in range(8)}
    mine[3] = "f" * 32  # changed
    mine[9] = f"{9:032x}"  # beyond the record
    assert held_chunks(recorded, mine) == {0, 1, 2, 4, 5, 6, 7}
    assert held_chunks(recorded, {}) == set()
