"""A second codec is one module: a gzip codec written here, registered, is usable by name
in a save's ``codecs=``, stored by TensorStore (big leaves) and by ckptstore's own chunks
(packed small leaves), restored bit-exact and read back by plain TensorStore. A package
names one in its ``ckptstore.codecs`` entry points and it is found by name; bad
registrations are typed errors."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.format.codecs import Codec, known, parse_codec, register_codec
from tests.distributions import installed


@dataclass(frozen=True)
class Gzip(Codec):
    """zarr3's gzip codec, at a level (a codec's whole module, short of its docs)."""

    name = "testgzip"
    level: int = 6

    @classmethod
    def from_argument(cls, argument: str | None) -> Gzip:
        if argument is not None and not argument.isdigit():
            raise ConfigError(f"gzip level must be 0 to 9, got {argument!r}")
        return cls(6 if argument is None else int(argument))

    def __str__(self) -> str:
        return f"testgzip:{self.level}"

    def zarr_codec(self) -> dict[str, Any]:
        return {"name": "gzip", "configuration": {"level": self.level}}

    def encode(self, data: Any) -> bytes:
        return gzip.compress(bytes(data), compresslevel=self.level, mtime=0)

    def decode_into(self, data: Any, out: np.ndarray[Any, Any], leaf: str) -> None:
        inflate = zlib.decompressobj(wbits=31)
        try:
            raw = inflate.decompress(bytes(data), out.nbytes + 1)
        except zlib.error as exc:
            raise CorruptCheckpointError(f"chunk does not inflate: {exc}", leaf=leaf) from exc
        if len(raw) != out.nbytes or not inflate.eof:
            raise CorruptCheckpointError("chunk inflates to another size", leaf=leaf)
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, np.uint8)


register_codec(Gzip)


def test_a_registered_codec_stores_big_and_small_leaves_and_restores_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    big = np.where(rng.random((1024, 2048)) < 0.7, 0, rng.standard_normal((1024, 2048)))
    tree = {"big": big.astype(np.float32), "small": np.arange(64, dtype=np.int32)}
    asyncio.run(ckptstore.save(str(tmp_path), tree, step=1, codecs="testgzip:4"))
    got = asyncio.run(ckptstore.restore(str(tmp_path), 1))
    assert all(got[k].tobytes() == tree[k].tobytes() for k in tree)
    item = asyncio.run(ckptstore.read_manifest(str(tmp_path), 1)).items["state"]
    assert {name: str(info.codec) for name, info in item.leaves.items()} == {
        "big": "testgzip:4",
        "small": "testgzip:4",
    }
    assert "small" in item.packed  # ckptstore's own chunk coder, not TensorStore's
    attempt = json.loads((tmp_path / "1" / "COMMITTED").read_text())["attempt"]
    store = {"driver": "ocdbt", "base": f"file://{tmp_path}/1/{attempt}/state/", "path": "big/"}
    arr = ts.open({"driver": "zarr3", "kvstore": store}).result()  # TensorStore's own gzip
    assert [c["name"] for c in arr.spec().to_json()["metadata"]["codecs"]] == [
        "bytes",
        "gzip",
        "crc32c",
    ]
    assert arr.read().result().tobytes() == tree["big"].tobytes()
    assert asyncio.run(ckptstore.verify(str(tmp_path), 1)).ok


def test_string_forms_of_a_registered_codec() -> None:
    assert parse_codec("testgzip") == Gzip(6) and parse_codec("TestGzip:2") == Gzip(2)
    assert "testgzip" in known() and "zstd" in known()
    with pytest.raises(ConfigError, match=r"codecs: gzip level must be 0 to 9, got 'x'"):
        parse_codec("testgzip:x", what="codecs")
    with pytest.raises(ConfigError, match=r"unknown codec 'brotli'.*'testgzip:<argument>'"):
        parse_codec("brotli")


def test_bad_registrations_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="expected a Codec subclass"):
        register_codec(dict)  # type: ignore[arg-type]

    @dataclass(frozen=True)
    class Other(Gzip):
        name = "zstd"

    with pytest.raises(ConfigError, match=r"'zstd' is already .*codecs\.zstd\.Zstd"):
        register_codec(Other)
    Other.name = "none"
    with pytest.raises(ConfigError, match="no usable name"):
        register_codec(Other)
    register_codec(Gzip)  # the same class again: nothing changes


def test_a_package_entry_point_names_a_codec(tmp_path: Path) -> None:
    """A distribution on the path (its dist-info as pip writes it) whose ``ckptstore.codecs``
    entry point names a codec class: the name is found the first time it is asked for."""
    source = (
        "from dataclasses import dataclass\n"
        "from tests.format.test_codec_registry import Gzip\n"
        "@dataclass(frozen=True)\n"
        "class Deflate(Gzip):\n"
        "    name = 'extdeflate'\n"
    )
    with installed(
        tmp_path, "extcodec", source, "ckptstore.codecs", "extdeflate = extcodec:Deflate"
    ):
        assert "extdeflate" not in known()
        codec = parse_codec("extdeflate:3")
        assert type(codec).__name__ == "Deflate" and codec.level == 3  # type: ignore[union-attr]
        assert "extdeflate" in known()
