"""Codecs per leaf, the format side: parsing and policies, compressed chunks and packs
encoded and decoded, zarr.json as TensorStore writes it, manifests that record codecs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.format import chunks
from ckptstore.format.codecs import CodecPolicy, Zstd, codec_name, parse_codec
from ckptstore.format.leaves import LeafInfo, describe_leaf, zarr_spec
from ckptstore.format.manifest import ItemManifest, Manifest
from ckptstore.format.packs import PackRef, entry_size, pack_parts, pack_refs
from ckptstore.format.tree import describe
from ckptstore.runtime.hostpool import ALIGNMENT

ZSTD3 = Zstd(3)


def info(
    name: str = "w", shape: tuple[int, ...] = (64, 32), codec: Zstd | None = ZSTD3
) -> LeafInfo:
    return LeafInfo(name, shape, "float32", shape, "numpy", codec=codec)


@pytest.mark.parametrize(
    ("text", "want"),
    [("none", None), ("zstd", Zstd(3)), ("zstd:1", Zstd(1)), (" ZSTD:22 ", Zstd(22)), (None, None)],
)
def test_codec_strings_parse(text: str | None, want: Zstd | None) -> None:
    assert parse_codec(text) == want
    assert parse_codec(codec_name(want)) == want  # the string form round-trips


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ("lz4", "unknown codec 'lz4'"),
        ("zstd:0", "1 to 22, got 0"),
        ("zstd:23", "1 to 22, got 23"),
        ("zstd:x", "must be an integer"),
        (3, "a codec is"),
        (True, "a codec is"),
    ],
)
def test_bad_codecs_are_config_errors_that_say_what(bad: object, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse_codec(bad, what="codecs")


def test_zstd_levels_are_checked_when_made() -> None:
    with pytest.raises(ConfigError, match="1 to 22"):
        Zstd(-1)
    with pytest.raises(ConfigError, match="integer"):
        Zstd(3.0)  # type: ignore[arg-type]


def test_policy_forms() -> None:
    kernel, bias = info("params/dense/kernel"), info("params/dense/bias", (8,))
    assert CodecPolicy.of(None).codec_for(kernel) is None
    assert CodecPolicy.of(None).empty
    assert CodecPolicy.of("zstd:5").codec_for(bias) == Zstd(5)
    rules = CodecPolicy.of({"*/kernel": Zstd(1), "params/*": "zstd:9", "*": "none"})
    assert rules.codec_for(kernel) == Zstd(1)  # the first matching pattern decides
    assert rules.codec_for(bias) == Zstd(9)
    assert rules.codec_for(info("opt/mu")) is None
    assert CodecPolicy.of({"params/*": "zstd"}).codec_for(info("opt/mu")) is None  # unmatched
    by_size = CodecPolicy.of(lambda name, i: "zstd:2" if i.nbytes > 100 else None)
    assert by_size.codec_for(kernel) == Zstd(2) and by_size.codec_for(bias) is None
    assert CodecPolicy.of(rules) is rules


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"": "zstd"}, "non-empty string"),
        ({3: "zstd"}, "pattern must be"),
        ({"w": "brotli"}, r"codecs\['w'\]: unknown codec"),
        (42, "expected a codec"),
        ([("w", "zstd")], "expected a codec"),
    ],
)
def test_bad_policies_are_config_errors(bad: object, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        CodecPolicy.of(bad)


def test_a_callable_returning_nonsense_is_a_config_error_naming_the_leaf() -> None:
    policy = CodecPolicy.of(lambda name, i: "gzip")
    with pytest.raises(ConfigError, match=r"codecs\('w'\): unknown codec 'gzip'"):
        policy.apply([info()])


def test_zarr_spec_puts_zstd_between_bytes_and_crc32c() -> None:
    spec = zarr_spec({"driver": "memory"}, info(codec=Zstd(7)))
    names = [c["name"] for c in spec["metadata"]["codecs"]]
    assert names == ["bytes", "zstd", "crc32c"]
    assert spec["metadata"]["codecs"][1]["configuration"] == {"level": 7, "checksum": False}
    raw = zarr_spec({"driver": "memory"}, info(codec=None))
    assert [c["name"] for c in raw["metadata"]["codecs"]] == ["bytes", "crc32c"]


def test_metadata_is_what_tensorstore_writes_for_a_compressed_leaf() -> None:
    leaf = info("a/b", (10, 7), Zstd(4))
    ctx = ts.Context()
    ts.open(zarr_spec({"driver": "memory"}, leaf), create=True, context=ctx).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    assert kv.read("a/b/zarr.json").result().value == chunks.encode_metadata(leaf)
    assert chunks.encode_metadata(leaf) != chunks.encode_metadata(info("a/b", (10, 7), None))


def test_compressed_chunks_round_trip_and_tensorstore_reads_ours() -> None:
    leaf = info()
    data = np.zeros(leaf.shape, np.float32)
    data[::7] = np.arange(32, dtype=np.float32)
    stored = chunks.encode_chunk(leaf, data)
    assert len(stored) < data.nbytes // 4  # compressed, then a checksum
    got = chunks.decode_chunk(leaf, stored)
    assert got.tobytes() == data.tobytes()
    ctx = ts.Context()  # a chunk written here is an ordinary zarr3 zstd chunk
    arr = ts.open(zarr_spec({"driver": "memory"}, leaf), create=True, context=ctx).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    kv.write(chunks.chunk_key(leaf), stored).result()
    assert arr.read().result().tobytes() == data.tobytes()


def test_chunks_tensorstore_compressed_decode_here() -> None:
    leaf = info(shape=(100, 30), codec=Zstd(1))
    data = np.random.default_rng(0).standard_normal(leaf.shape).astype(np.float32)
    ctx = ts.Context()
    arr = ts.open(zarr_spec({"driver": "memory"}, leaf), create=True, context=ctx).result()
    arr.write(data).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    stored = kv.read(chunks.chunk_key(leaf)).result().value
    assert chunks.decode_chunk(leaf, stored).tobytes() == data.tobytes()


def test_damaged_compressed_chunks_are_corruption() -> None:
    leaf = info()
    stored = bytearray(chunks.encode_chunk(leaf, np.ones(leaf.shape, np.float32)))
    flipped = bytearray(stored)
    flipped[5] ^= 1
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        chunks.decode_chunk(leaf, bytes(flipped))
    # A chunk whose checksum matches but whose frame is not the leaf's: decompression
    # or the size check says so, whichever comes first.
    other = chunks.encode_chunk(info(shape=(64, 16)), np.ones((64, 16), np.float32))
    with pytest.raises(CorruptCheckpointError, match="bytes, 8192 expected"):
        chunks.decode_chunk(leaf, other)
    garbage = b"not zstd at all" + chunks.checksum(np.frombuffer(b"not zstd at all", np.uint8))
    with pytest.raises(CorruptCheckpointError, match="zstd") as caught:
        chunks.decode_chunk(leaf, garbage)
    assert caught.value.leaf == "w"
    with pytest.raises(CorruptCheckpointError, match="at most"):
        chunks.decode_chunk(leaf, b"\0" * (chunks.stored_size(leaf) + 1))


def test_packs_record_a_compressed_entrys_size() -> None:
    leaves = [
        (info("a", (1000,), Zstd(3)), np.zeros(1000, np.float32)),
        (info("b", (10,), None), np.arange(10, dtype=np.float32)),
        (info("c", (500,), Zstd(1)), np.full(500, 2.0, np.float32)),
    ]
    parts, offsets = pack_parts(leaves)
    refs = pack_refs("pack-0", leaves, parts, offsets)
    assert refs[1].size is None and refs[0].size is not None and refs[2].size is not None
    assert refs[0].size < 4000
    blob = b"".join(bytes(memoryview(p)) for p in parts)
    for (leaf, arr), ref in zip(leaves, refs, strict=True):
        start = ref.offset + len(chunks.encode_metadata(leaf))
        end = ref.offset + entry_size(leaf, ref)
        assert chunks.decode_chunk(leaf, blob[start:end]).tobytes() == arr.tobytes()
    assert refs[2].offset + entry_size(leaves[2][0], refs[2]) == len(blob)


def _manifest(leaf_doc: dict, packed: dict | None = None) -> bytes:
    tree = {"w": np.zeros(4, np.float32)}
    leaf = describe_leaf("w", tree["w"])
    item = ItemManifest(structure=describe(tree), leaves={"w": leaf})
    doc = json.loads(
        Manifest(step=1, items={"state": item}, attempt=None, format_version=1).to_bytes()
    )
    doc["items"]["state"]["leaves"]["w"].update(leaf_doc)
    if packed is not None:
        doc["items"]["state"]["packed"] = {"w": packed}
    return json.dumps(doc).encode()


def test_the_manifest_records_codecs_and_old_records_read_as_none() -> None:
    plain = Manifest.from_bytes(_manifest({}), where="m")
    assert plain.items["state"].leaves["w"].codec is None
    assert '"codec"' not in plain.to_bytes().decode()  # raw leaves' records are unchanged
    zstd = Manifest.from_bytes(_manifest({"codec": "zstd:5"}), where="m")
    assert zstd.items["state"].leaves["w"].codec == Zstd(5)
    again = Manifest.from_bytes(zstd.to_bytes(), where="m")
    assert again.items["state"].leaves["w"].codec == Zstd(5)


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"codec": "lz4"}, "unknown codec 'lz4'"),
        ({"codec": "zstd:99"}, "1 to 22"),
        ({"codec": 3}, "bad codec"),
        ({"codec": "none"}, "bad codec"),  # raw is written as no field at all
        ({"codec": {"name": "zstd"}}, "bad codec"),
    ],
)
def test_a_manifest_with_an_unknown_codec_is_corrupt(doc: dict, said: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=said):
        Manifest.from_bytes(_manifest(doc), where="m")


@pytest.mark.parametrize(
    ("codec", "packed", "said"),
    [
        ("zstd:3", {"key": "p", "offset": 0}, "has no size with codec zstd:3"),
        (None, {"key": "p", "offset": 0, "size": 10}, "has size 10 with codec None"),
        ("zstd:3", {"key": "p", "offset": 0, "size": 1 << 40}, "too large"),
        ("zstd:3", {"key": "p", "offset": 0, "size": "9"}, "bad packed size"),
    ],
)
def test_packed_sizes_must_fit_the_leafs_codec(codec: str | None, packed: dict, said: str) -> None:
    doc = {"codec": codec} if codec else {}
    with pytest.raises(CorruptCheckpointError, match=said):
        Manifest.from_bytes(_manifest(doc, packed), where="m")
    ok = {"key": "p", "offset": 0, **({"size": 12} if codec else {})}
    parsed = Manifest.from_bytes(_manifest(doc, ok), where="m")
    assert parsed.items["state"].packed["w"] == PackRef("p", 0, 12 if codec else None)


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"cast_from": "int8"}, "bad cast_from 'int8'"),
        ({"cast_from": "float32"}, "bad cast_from"),  # the stored dtype itself: no cast
        ({"cast_from": ["float64"]}, "bad cast_from"),
    ],
)
def test_a_manifest_with_a_bad_cast_is_corrupt(doc: dict, said: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=said):
        Manifest.from_bytes(_manifest(doc), where="m")
    good = Manifest.from_bytes(_manifest({"cast_from": "float64"}), where="m")
    assert good.items["state"].leaves["w"].cast_from == "float64"


def test_incompressible_chunks_fit_the_bound_readers_allocate() -> None:
    """Random bytes grow a little under zstd: what TensorStore and ckptstore write for them
    still fits `chunks.stored_size` and decodes."""
    leaf = LeafInfo("r", (1 << 17,), "uint8", (1 << 17,), "numpy", codec=Zstd(22))
    data = np.random.default_rng(5).integers(0, 256, leaf.shape, dtype=np.uint8)
    ours = chunks.encode_chunk(leaf, data)
    ctx = ts.Context()
    arr = ts.open(zarr_spec({"driver": "memory"}, leaf), create=True, context=ctx).result()
    arr.write(data).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    theirs = kv.read(chunks.chunk_key(leaf)).result().value
    for stored in (ours, theirs):
        assert data.nbytes < len(stored) <= chunks.stored_size(leaf)
        assert chunks.decode_chunk(leaf, stored).tobytes() == data.tobytes()


def _framed(payload: bytes) -> bytes:
    """``payload`` as a stored chunk: the bytes, then their crc32c."""
    return payload + chunks.checksum(np.frombuffer(payload, np.uint8))


@pytest.mark.parametrize("held", [8191, 8193])
def test_a_frame_without_its_size_decoding_to_another_size_is_corruption(held: int) -> None:
    """A frame whose header does not say its size (the decoder learns it only by
    decoding) that holds a byte less or more than the chunk: corruption, not a partly
    filled or overrun chunk."""
    import zstandard

    leaf = info()  # 64 x 32 float32: 8,192 bytes
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * held)
    with pytest.raises(CorruptCheckpointError, match="8192 expected"):
        chunks.decode_chunk(leaf, _framed(frame))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "uint32", "bool", "int8"])
def test_compressed_chunks_of_any_dtype_decode_bit_exact(dtype: str) -> None:
    leaf = LeafInfo("w", (16, 8), dtype, (16, 8), "numpy", codec=Zstd(1))
    values = np.arange(128).reshape(16, 8) % 7
    want = np.asarray(values, chunks.dtype_of(dtype))
    got = chunks.decode_chunk(leaf, chunks.encode_chunk(leaf, want))
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert got.ctypes.data % ALIGNMENT == 0  # where devices may adopt it
