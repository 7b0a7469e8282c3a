"""Compressed leaves end to end: saves with ``codecs=`` restore bit-exact (big leaves
through TensorStore, packed and raw-key small leaves through ckptstore's own chunks) on
local disk, memory and S3; plain TensorStore reads them; verify passes and catches damage;
an incremental save writes a leaf whose codec changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.sizes import stored_sizes
from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.format import chunks, layout
from ckptstore.format.codecs import Zstd
from tests.conftest import make_backend
from tests.paths import committed_root


def compressible(shape: tuple[int, ...], dtype: Any = np.float32, seed: int = 0) -> np.ndarray:
    """Values like trained weights' (few distinct magnitudes, many zeros): zstd shrinks them."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32)
    values[rng.random(shape) < 0.6] = 0  # sparse, as pruned or freshly initialized layers
    return values.astype(dtype)


def sharded(value: np.ndarray, spec: P) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    return jax.device_put(value, NamedSharding(mesh, spec))


def a_tree() -> dict[str, Any]:
    return {
        "params": {
            "kernel": sharded(compressible((1024, 1024)), P("x", "y")),  # 4 MiB, 8 chunks
            "embed": compressible((2048, 1024), ml_dtypes.bfloat16, 1),  # 4 MiB: one big chunk
            "bias": compressible((256,), seed=2),  # small: packed
        },
        "opt": {"mu": compressible((64, 64), seed=3), "count": np.int64(7)},
        "step": 12,
    }


CODECS = {"params/*": "zstd:3", "opt/mu": ckptstore.Zstd(1)}


def assert_bit_exact(got: Any, want: Any) -> None:
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(params=["local", "memory", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    made = await make_backend(request.param, request, tmp_path)
    async with made:
        yield made


async def test_compressed_leaves_round_trip_bit_exact(backend: Backend) -> None:
    tree = a_tree()
    await ckptstore.save(backend, tree, step=1, codecs=CODECS)
    assert_bit_exact(await ckptstore.restore(backend, 1), tree)
    manifest = await ckptstore.read_manifest(backend, 1)
    item = manifest.items["state"]
    codecs = {name: info.codec for name, info in item.leaves.items()}
    assert codecs == {
        "params/kernel": Zstd(3),
        "params/embed": Zstd(3),
        "params/bias": Zstd(3),
        "opt/mu": Zstd(1),
        "opt/count": None,
        "step": None,
    }
    assert {"params/bias", "opt/mu", "opt/count", "step"} <= set(item.packed)
    sizes = (await stored_sizes(backend, manifest))["state"]
    for name in ("params/kernel", "params/embed", "params/bias", "opt/mu"):
        assert sizes[name] is not None and sizes[name] < 0.8 * item.leaves[name].nbytes, name
    assert sizes["opt/count"] == 8 + 4  # raw: the data and its checksum
    report = await ckptstore.verify(backend, 1)
    assert report.ok and report.leaves == 6, report


async def test_a_restore_onto_another_mesh_reads_compressed_chunks(tmp_path: Path) -> None:
    tree = {"w": sharded(compressible((512, 256)), P("x", "y"))}
    await ckptstore.save(str(tmp_path), tree, step=1, codecs="zstd:2")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    like = {
        "w": jax.ShapeDtypeStruct((512, 256), np.float32, sharding=NamedSharding(mesh, P("b", "a")))
    }
    got = await ckptstore.restore(str(tmp_path), 1, like=like)
    assert got["w"].sharding == like["w"].sharding
    assert np.asarray(got["w"]).tobytes() == np.asarray(tree["w"]).tobytes()


async def test_plain_tensorstore_reads_a_compressed_big_leaf(tmp_path: Path) -> None:
    kernel = compressible((1024, 2048))  # 8 MiB: TensorStore's writer, two chunks
    await ckptstore.save(str(tmp_path), {"params": {"kernel": kernel}}, step=3, codecs="zstd:3")
    attempt = json.loads((tmp_path / "3" / "COMMITTED").read_text())["attempt"]
    store = {
        "driver": "ocdbt",
        "base": f"file://{tmp_path}/3/{attempt}/state/",
        "path": "params/kernel/",
    }
    arr = ts.open({"driver": "zarr3", "kvstore": store}).result()  # no spec of ours
    codecs = arr.spec().to_json()["metadata"]["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "zstd", "crc32c"]
    assert arr.read().result().tobytes() == kernel.tobytes()
    # Its zarr.json is the one ckptstore's own chunk reader accepts (no TensorStore fallback).
    manifest = await ckptstore.read_manifest(str(tmp_path), 3)
    info = manifest.items["state"].leaves["params/kernel"]
    kv = ts.KvStore.open({**store, "path": ""}).result()
    assert chunks.as_written(info, kv.read("params/kernel/zarr.json").result().value)


async def test_raw_key_small_leaves_of_a_partial_save_compress(tmp_path: Path) -> None:
    root = str(tmp_path)
    session = await ckptstore.partial_save(root, 4)
    await session.add({"a": compressible((300,))}, codecs="zstd:5")
    await session.add({"b": compressible((1500, 1500), seed=1)}, codecs={"b": "zstd:1"})
    await session.add({"c": np.arange(10)})
    await session.finalize()
    got = await ckptstore.restore(root, 4)
    assert got["a"].tobytes() == compressible((300,)).tobytes()
    assert got["b"].tobytes() == compressible((1500, 1500), seed=1).tobytes()
    assert got["c"].tobytes() == np.arange(10).tobytes()
    leaves = (await ckptstore.read_manifest(root, 4)).items["state"].leaves
    assert (leaves["a"].codec, leaves["b"].codec, leaves["c"].codec) == (Zstd(5), Zstd(1), None)
    assert (await ckptstore.verify(root, 4)).ok


async def test_verify_catches_a_flipped_byte_in_compressed_data(tmp_path: Path) -> None:
    backend = await make_backend("local", None, tmp_path)  # type: ignore[arg-type]
    tree = {"big": compressible((1024, 2048)), "small": compressible((100,), seed=1)}
    await ckptstore.save(backend, tree, step=1, codecs="zstd:3")
    root = await committed_root(backend, 1)
    stores = [i async for i in backend.list(f"{root}/state/ocdbt.process_0")]
    pack = next(i.key for i in stores if "/pack-" in i.key)
    data_file = max((i for i in stores if "/pack-" not in i.key), key=lambda i: i.size).key
    for key, leaf in ((data_file, "big"), (pack, "small")):
        original = await backend.read(key)
        damaged = bytearray(original)
        damaged[-20 if key == pack else len(damaged) // 2] ^= 0x08
        await backend.write(key, bytes(damaged))
        report = await ckptstore.verify(backend, 1)
        assert not report.ok and f"state/{leaf}" in report.problems, (leaf, report)
        with pytest.raises(ckptstore.CorruptCheckpointError) as caught:
            await ckptstore.restore(backend, 1)
        assert caught.value.leaf == leaf
        await backend.write(key, original)
    assert (await ckptstore.verify(backend, 1)).ok


async def test_an_incremental_save_writes_a_leaf_whose_codec_changed(tmp_path: Path) -> None:
    root = str(tmp_path)
    tree = {"frozen": compressible((1024, 1024)), "small": compressible((50,), seed=1)}
    await ckptstore.save(root, tree, step=1)
    second = await ckptstore.save(root, tree, step=2, base=1, codecs={"frozen": "zstd:3"})
    manifest = await ckptstore.read_manifest(root, 2)
    assert manifest.items["state"].refs.keys() == {"small"}  # same codec: referenced
    assert second.bytes_referenced == tree["small"].nbytes
    assert manifest.items["state"].leaves["frozen"].codec == Zstd(3)
    third = await ckptstore.save(root, tree, step=3, base=2, codecs={"frozen": "zstd:3"})
    assert third.bytes_referenced == tree["frozen"].nbytes + tree["small"].nbytes
    fourth = await ckptstore.save(root, tree, step=4, base=3, codecs={"frozen": "zstd:1"})
    assert fourth.bytes_referenced == tree["small"].nbytes  # another level: other bytes
    for step in (2, 3, 4):
        assert_bit_exact(await ckptstore.restore(root, step), tree)
        assert (await ckptstore.verify(root, step)).ok


async def test_bad_codecs_fail_typed_before_anything_is_written(tmp_path: Path) -> None:
    for bad, said in [
        ("lz4", "unknown codec 'lz4'"),
        ("zstd:40", "1 to 22"),
        ({"w": "zstd:0"}, r"codecs\['w'\]"),
        (7, "expected a codec"),
    ]:
        with pytest.raises(ConfigError, match=said):
            await ckptstore.save(str(tmp_path), {"w": np.zeros(3)}, step=1, codecs=bad)
    assert not list(tmp_path.iterdir())


def test_without_codecs_a_save_writes_what_it_always_did(tmp_path: Path) -> None:
    tree = {"w": compressible((1024, 1024)), "b": np.arange(4.0)}
    ckptstore.save_sync(tmp_path / "a", tree, step=1)
    ckptstore.save_sync(tmp_path / "b", tree, step=1, codecs={"nothing/*": "zstd"})
    for where in ("a", "b"):
        text = ckptstore.read_manifest_sync(tmp_path / where, 1).to_bytes().decode()
        assert '"codec"' not in text and '"size"' not in text
    sizes = [
        sum(
            p.stat().st_size
            for p in (tmp_path / w).rglob("*")
            if p.is_file() and "ocdbt.process" in str(p)
        )
        for w in ("a", "b")
    ]
    assert sizes[0] == sizes[1] > tree["w"].nbytes


def test_a_compressed_step_is_version_5_and_a_reader_of_4_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a compressed (or cast) leaf says format version 5, so a reader of an
    older version refuses it by its version instead of reading
    compressed chunks as raw ones; a step without one stays version 3."""
    tree = {"w": compressible((256, 256)), "b": np.arange(4.0)}
    ckptstore.save_sync(tmp_path / "plain", tree, step=1)
    ckptstore.save_sync(tmp_path / "zstd", tree, step=1, codecs={"w": "zstd:1"})
    ckptstore.save_sync(tmp_path / "cast", tree, step=1, casts={"w": "bfloat16"})
    versions = {
        w: ckptstore.read_manifest_sync(tmp_path / w, 1).format_version
        for w in ("plain", "zstd", "cast")
    }
    assert versions == {"plain": 3, "zstd": 5, "cast": 5}
    monkeypatch.setattr(layout, "FORMAT_VERSION", 4)  # a reader of version 4
    with pytest.raises(CorruptCheckpointError, match="format version 5 is newer"):
        ckptstore.restore_sync(tmp_path / "zstd", 1)
    assert_bit_exact(ckptstore.restore_sync(tmp_path / "plain", 1), tree)


# ---- lossy casts, only where asked ----


async def test_cast_leaves_are_stored_narrower_and_restored_in_their_dtype(tmp_path: Path) -> None:
    root = str(tmp_path)
    mu = compressible((512, 1024))
    tree = {
        "opt": {"mu": sharded(mu, P("x", "y")), "count": np.arange(4)},
        "f64": np.linspace(0, 1, 1000),
        "keep": np.full(10, 1 / 3, np.float32),
        "half": np.ones(4, np.float16),
    }
    casts = {"opt/*": "bfloat16", "f64": np.float32, "half": "float32"}
    await ckptstore.save(root, tree, step=1, casts=casts, codecs={"opt/*": "zstd:1"})
    leaves = (await ckptstore.read_manifest(root, 1)).items["state"].leaves
    stored = {n: (i.dtype, i.cast_from) for n, i in leaves.items()}
    assert stored == {
        "opt/mu": ("bfloat16", "float32"),
        "opt/count": ("int64", None),  # not floating point: as it is
        "f64": ("float32", "float64"),
        "keep": ("float32", None),  # no pattern
        "half": ("float16", None),  # a widening is no cast
    }
    assert leaves["opt/mu"].codec == Zstd(1)
    want_mu = mu.astype(ml_dtypes.bfloat16).astype(np.float32)  # rounded once, to nearest even
    got = await ckptstore.restore(root, 1)
    assert got["opt"]["mu"].dtype == np.float32 and got["opt"]["mu"].tobytes() == want_mu.tobytes()
    assert got["f64"].dtype == np.float64
    assert got["f64"].tobytes() == tree["f64"].astype(np.float32).astype(np.float64).tobytes()
    assert got["keep"].tobytes() == tree["keep"].tobytes()
    like = {
        "opt": {
            "mu": jax.ShapeDtypeStruct(mu.shape, np.float32, sharding=tree["opt"]["mu"].sharding),
            "count": np.zeros(4, np.int64),
        },
        "f64": np.zeros(1000),
        "keep": np.zeros(10, np.float32),
        "half": np.zeros(4, np.float16),
    }
    placed = await ckptstore.restore(root, 1, like=like)
    assert placed["opt"]["mu"].sharding == tree["opt"]["mu"].sharding
    assert np.asarray(placed["opt"]["mu"]).tobytes() == want_mu.tobytes()
    like["opt"]["mu"] = jax.ShapeDtypeStruct(mu.shape, ml_dtypes.bfloat16)  # as stored
    as_stored = await ckptstore.restore(root, 1, like=like)
    assert as_stored["opt"]["mu"].dtype == ml_dtypes.bfloat16
    assert (await ckptstore.verify(root, 1)).ok


def test_a_partial_save_casts_the_leaves_a_part_asks_for(tmp_path: Path) -> None:
    """`PartialSave.add(casts=)`: the part's chosen leaves are stored narrower and restored
    into their dtype; another part's leaves are not touched; a bad cast writes nothing."""
    mu, w = compressible((256, 64)), compressible((64,), seed=1)
    with ckptstore.partial_save_sync(tmp_path, 2) as session:
        session.add({"opt": {"mu": mu}}, casts={"opt/*": "bfloat16"}, codecs="zstd:1")
        session.add({"w": w})
        with pytest.raises(ConfigError, match="casts"):
            session.add({"x": np.ones(3)}, casts={"x": "int8"})
        assert len(session.parts) == 2
        session.finalize()
    leaves = ckptstore.read_manifest_sync(tmp_path, 2).items["state"].leaves
    assert (leaves["opt/mu"].dtype, leaves["opt/mu"].cast_from) == ("bfloat16", "float32")
    assert (leaves["w"].dtype, leaves["w"].cast_from) == ("float32", None)
    got = ckptstore.restore_sync(tmp_path, 2)
    want = mu.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert got["opt"]["mu"].dtype == np.float32 and got["opt"]["mu"].tobytes() == want.tobytes()
    assert got["w"].tobytes() == w.tobytes()


async def test_casts_are_never_a_default_and_bad_ones_are_typed(tmp_path: Path) -> None:
    tree = {"w": np.full(8, 1 / 3, np.float32)}
    await ckptstore.save(str(tmp_path), tree, step=1)
    assert (await ckptstore.restore(str(tmp_path), 1))["w"].tobytes() == tree["w"].tobytes()
    for bad, said in [
        ({"w": "int8"}, "cannot store leaves as 'int8'"),
        ({"w": "float128"}, "cannot store leaves as"),
        ("bfloat16", "expected {pattern: dtype}"),
    ]:
        with pytest.raises(ConfigError, match=said):
            await ckptstore.save(str(tmp_path), tree, step=2, casts=bad)
    assert await ckptstore.list_steps(str(tmp_path)) == [1]
