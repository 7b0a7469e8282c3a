"""Streaming safetensors import on every backend, compared tensor by tensor."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.cli import main
from ckptstore.errors import SafetensorsError
from ckptstore.importers.safetensors import find_tensors, import_safetensors
from ckptstore.testing.faults import FaultyBackend, InjectedPermanentFault


def make_tensors(seed: int = 0, layers: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {
        "model.embed.weight": rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16),
        "lm_head.weight": rng.standard_normal((16, 64)).astype(np.float16),
        "model.norm.scale": rng.standard_normal(16).astype(np.float32),
        "model.step": np.array(1234, np.int64),
        "model.mask": rng.random(8) > 0.5,
        "model.fp8": rng.standard_normal(12).astype(ml_dtypes.float8_e4m3fn),
    }
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up.weight"] = rng.standard_normal((32, 16)).astype(
            ml_dtypes.bfloat16
        )
        tensors[f"model.layers.{i}.mlp.down.weight"] = rng.standard_normal((16, 32)).astype(
            np.float32
        )
    return tensors


def write_sharded(folder: Path, tensors: dict[str, np.ndarray], shards: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mine = names[s::shards]
        save_file({n: tensors[n] for n in mine}, str(folder / file))
        weight_map.update({n: file for n in mine})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return folder


def lookup(tree: dict[str, Any], dotted: str, sep: str = ".") -> Any:
    node: Any = tree
    for key in dotted.split(sep):
        node = node[key]
    return node


def assert_bit_exact(a: np.ndarray, b: np.ndarray) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


async def test_sharded_model_roundtrips_bit_exact(any_backend: Backend, tmp_path: Path) -> None:
    tensors = make_tensors()
    folder = write_sharded(tmp_path / "model", tensors)
    result = await import_safetensors(folder, any_backend, step=1, batch_bytes=4096)
    assert result.tensors == len(tensors) and result.skipped == 0
    assert result.parts > 3  # small batches: many parts
    restored = await ckptstore.restore(any_backend, step=1)
    for name, value in tensors.items():
        assert_bit_exact(lookup(restored, name), value)


async def test_rules_rename_transpose_cast_skip(any_backend: Backend, tmp_path: Path) -> None:
    tensors = make_tensors(layers=2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    rules = tmp_path / "rules.toml"
    rules.write_text(
        textwrap.dedent(
            r"""
            [[rule]]
            match = 'model\.layers\.(\d+)\.mlp\.(\w+)\.weight'
            path = 'layers/\1/\2/kernel'
            transpose = true
            [[rule]]
            match = 'model\.norm\.scale'
            path = 'final_norm/scale'
            dtype = "bfloat16"
            [[rule]]
            match = 'lm_head\..*'
            skip = true
            """
        )
    )
    result = await import_safetensors(tmp_path / "model.safetensors", any_backend, rules=rules)
    assert result.skipped == 1
    out = await ckptstore.restore(any_backend)
    for i in range(2):
        for kind in ("up", "down"):
            want = tensors[f"model.layers.{i}.mlp.{kind}.weight"].T
            assert_bit_exact(out["layers"][str(i)][kind]["kernel"], np.ascontiguousarray(want))
    assert_bit_exact(
        out["final_norm"]["scale"], tensors["model.norm.scale"].astype(ml_dtypes.bfloat16)
    )
    assert "lm_head" not in out
    assert_bit_exact(out["model"]["embed"]["weight"], tensors["model.embed.weight"])


async def test_interrupted_import_resumes(any_backend: Backend, tmp_path: Path) -> None:
    tensors = make_tensors(layers=6)
    folder = write_sharded(tmp_path / "model", tensors)
    faulty = FaultyBackend(
        any_backend, fail_on={4}, ops={"create"}, error="permanent", retry=RetryPolicy(1)
    )
    with pytest.raises(InjectedPermanentFault):
        await import_safetensors(folder, faulty, step=2, batch_bytes=2048)
    assert await ckptstore.list_steps(any_backend) == []

    result = await import_safetensors(folder, any_backend, step=2, batch_bytes=2048)
    assert result.skipped > 0  # the completed parts were kept
    assert result.tensors + result.skipped == len(tensors)
    restored = await ckptstore.restore(any_backend, step=2)
    for name, value in tensors.items():
        assert_bit_exact(lookup(restored, name), value)


def test_sources_and_bad_input(tmp_path: Path) -> None:
    tensors = make_tensors(layers=1)
    folder = tmp_path / "plain"
    folder.mkdir()
    save_file(dict(list(tensors.items())[:3]), str(folder / "a.safetensors"))
    save_file(dict(list(tensors.items())[3:]), str(folder / "b.safetensors"))
    assert sorted(r.name for r in find_tensors(folder)) == sorted(tensors)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(SafetensorsError, match="impossible"):
        find_tensors(tmp_path / "junk.safetensors")
    with pytest.raises(SafetensorsError, match="no such file"):
        find_tensors(tmp_path / "missing.safetensors")
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes((folder / "a.safetensors").read_bytes()[:-10])
    with pytest.raises(SafetensorsError, match="inconsistent"):
        find_tensors(truncated)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = make_tensors(layers=1)
    folder = write_sharded(tmp_path / "model", tensors, shards=2)
    dst = str(tmp_path / "ckpt")
    assert main(["import-safetensors", str(folder), dst, "--step", "5", "--no-progress"]) == 0
    assert f"imported {len(tensors)} tensors" in capsys.readouterr().out
    restored = ckptstore.restore_sync(dst, step=5)
    assert_bit_exact(restored["model"]["embed"]["weight"], tensors["model.embed.weight"])


async def test_import_stores_leaves_as_codecs_and_casts_say(
    any_backend: Backend, tmp_path: Path
) -> None:
    tensors = make_tensors(layers=2)
    folder = write_sharded(tmp_path / "model", tensors)
    codecs = {"model/embed/*": "zstd:3", "*": "zstd:1"}
    casts = {"model/layers/*/mlp/down/weight": "bfloat16"}
    await import_safetensors(folder, any_backend, step=2, codecs=codecs, casts=casts)
    leaves = (await ckptstore.read_manifest(any_backend, 2)).items["state"].leaves
    assert str(leaves["model/embed/weight"].codec) == "zstd:3"
    assert str(leaves["lm_head/weight"].codec) == "zstd:1"
    down = leaves["model/layers/1/mlp/down/weight"]
    assert (down.dtype, down.cast_from) == ("bfloat16", "float32")
    assert leaves["model/layers/1/mlp/up/weight"].cast_from is None
    restored = await ckptstore.restore(any_backend, 2)
    for name, want in tensors.items():
        got = lookup(restored, name)
        if name.endswith("mlp.down.weight"):  # rounded to bfloat16, restored as float32
            want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert_bit_exact(got, want)
    assert (await ckptstore.verify(any_backend, 2)).ok


def test_a_bad_codec_or_cast_fails_before_anything_is_written(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "model", make_tensors(layers=1))
    dst = tmp_path / "ckpt"
    with pytest.raises(ckptstore.ConfigError, match="unknown codec 'lz4'"):
        asyncio.run(import_safetensors(folder, dst, codecs="lz4"))
    with pytest.raises(ckptstore.ConfigError, match="int8"):
        asyncio.run(import_safetensors(folder, dst, casts={"*": "int8"}))
    assert not dst.exists()


def test_command_line_codec_and_cast_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = make_tensors(layers=1)
    folder = write_sharded(tmp_path / "model", tensors, shards=2)
    dst = str(tmp_path / "ckpt")
    flags = ["--codec", "model/embed/*=zstd:3", "--codec", "zstd:1"]
    flags += ["--cast", "lm_head/*=float8_e4m3fn"]
    assert main(["import-safetensors", str(folder), dst, "--no-progress", *flags]) == 0
    capsys.readouterr()
    assert main(["info", dst, "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)["stored"]["state"]
    assert stored["model/embed/weight"]["codec"] == "zstd:3"
    assert stored["model/norm/scale"]["codec"] == "zstd:1"
    leaves = ckptstore.read_manifest_sync(dst).items["state"].leaves
    assert (leaves["lm_head/weight"].dtype, leaves["lm_head/weight"].cast_from) == (
        "float8_e4m3fn",
        "float16",
    )
    restored = ckptstore.restore_sync(dst)
    assert_bit_exact(restored["model"]["embed"]["weight"], tensors["model.embed.weight"])
    for bad in (["--codec", "lz4"], ["--codec", "=zstd"], ["--cast", "*=int8"]):
        assert main(["import-safetensors", str(folder), str(tmp_path / "x"), *bad]) == 2
        assert "--c" in capsys.readouterr().err
    twice = ["--codec", "a=zstd", "--codec", "a=none"]
    assert main(["import-safetensors", str(folder), str(tmp_path / "x"), *twice]) == 2
    assert "given twice" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


MEMORY_PROBE = textwrap.dedent(
    """
    import asyncio, resource, sys
    from ckptstore.importers.safetensors import import_safetensors

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    async def main():
        base = peak_mib()
        batch = {"batch_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}  # else default
        await import_safetensors(sys.argv[1], sys.argv[2], **batch)
        print(peak_mib() - base)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize(("batch", "most"), [(16 << 20, 96), (None, 8 + 256)])
def test_peak_memory_is_bounded_by_batch_not_model(
    tmp_path: Path, batch: int | None, most: int
) -> None:
    """A 256 MiB model of 8 MiB tensors: the import's added peak RSS (TensorStore's buffers
    included) stays under ``most`` MiB: with the default batch, the largest tensor + 256 MiB."""
    folder = tmp_path / "big"
    folder.mkdir()
    rng = np.random.default_rng(3)
    for s in range(8):  # 8 shards x 4 tensors x 8 MiB = 256 MiB
        save_file(
            {f"layer{s}.t{i}": rng.standard_normal(2 << 20, dtype=np.float32) for i in range(4)},
            str(folder / f"shard{s}.safetensors"),
        )
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(folder), str(tmp_path / "ckpt")]
        + ([str(batch)] if batch else []),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    added = float(proc.stdout.split()[-1])
    assert added < most, f"import added {added:.0f} MiB of peak RSS for a 256 MiB model"


def hand_made(path: Path, header: str, data: bytes = bytes(64)) -> Path:
    """A safetensors file with exactly this JSON header (as an attacker would write it)."""
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ('{"a": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}', "bad shape"),
        (
            '{"a": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}}',
            "inconsistent",
        ),
        ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}', "bad data offsets"),
        ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [true, 9]}}', "bad data offsets"),
        ('{"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}', "bad shape"),
        (
            '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            '"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            "twice",
        ),
        (
            '{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
            '"b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}',
            "overlap",
        ),
        ('{"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}', "unsupported dtype"),
        ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}', "bad data offsets"),
        ("[" * 100000 + "]" * 100000, "not JSON"),
    ],
    ids=[
        "negative",
        "overflow",
        "float offsets",
        "bool offset",
        "float dim",
        "duplicate",
        "overlap",
        "dtype list",
        "one offset",
        "deep",
    ],
)
def test_hostile_headers_are_refused_by_name(tmp_path: Path, header: str, why: str) -> None:
    file = hand_made(tmp_path / "evil.safetensors", header)
    with pytest.raises(SafetensorsError, match=why):
        find_tensors(file)
