"""Orbax checkpoints declaring sizes their stored bytes cannot hold: refused typed, before
any buffer is sized by them, in a process that cannot map even 4 GiB.

Before: a ``.zarray`` edited to declare ``[2**34]`` (or ``[2**31]``, or ``[2**34]`` in small
chunks) sized a 128 GiB read in TensorStore, whose failed allocation (``std::bad_alloc``)
aborted the process; ``ckptstore info`` printed the sizes as terabytes and exited 0. A
``_METADATA`` sequence index of 10**30 raised an untyped TypeError.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.cli import main as cli
from ckptstore.orbax import read as orbax

#: id -> (shape, chunks) written into array w's ``.zarray`` (it stores 4 float64 values).
SIZES: dict[str, tuple[list[int], list[int]]] = {
    "2**34 in one chunk": ([2**34], [2**34]),
    "2**31 in one chunk": ([2**31], [2**31]),
    "2**34 in the stored chunks": ([2**34], [4]),
    "2**40 x 2**40": ([2**40, 2**40], [4, 4]),
    "2**40 x 2**40 in one chunk": ([2**40, 2**40], [2**40, 2**40]),
}
LAYOUTS = ("plain", "ocdbt")


def orbax_save(path: Path, tree: Any, ocdbt: bool) -> None:
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=ocdbt)
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    checkpointer.close()


def declare(path: Path, ocdbt: bool, shape: list[int], chunks: list[int]) -> None:
    """Rewrite array w's ``.zarray`` (in place, or inside the OCDBT store) as a forger would."""
    if not ocdbt:
        zarray = path / "w" / ".zarray"
        doc = json.loads(zarray.read_text())
        doc.update(shape=shape, chunks=chunks)
        zarray.write_text(json.dumps(doc))
        return
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    doc = json.loads(kv.read("w/.zarray").result().value)
    doc.update(shape=shape, chunks=chunks)
    kv.write("w/.zarray", json.dumps(doc).encode()).result()


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One Orbax checkpoint per layout and declared size: id "layout/size" -> its path."""
    base = tmp_path_factory.mktemp("orbax-sizes")
    out = {}
    for layout in LAYOUTS:
        template = base / f"template-{layout}"
        orbax_save(template, {"w": np.arange(4.0), "v": np.arange(3)}, layout == "ocdbt")
        for name, (shape, chunks) in SIZES.items():
            path = base / f"{layout}-{len(out)}"
            shutil.copytree(template, path)
            declare(path, layout == "ocdbt", shape, chunks)
            out[f"{layout}/{name}"] = path
    return out


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    limit = 4 << 30  # address space: a 16 GiB or 128 GiB buffer fails here (bad_alloc)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import ckptstore
    from ckptstore.cli import main
    for path in sys.argv[1:]:
        try:
            ckptstore.restore_sync(path)
            print(json.dumps(["restore", "no error"]), flush=True)
        except ckptstore.CkptStoreError as exc:
            print(json.dumps(["restore", type(exc).__name__ + ": " + str(exc)]), flush=True)
        for command in ("info", "verify", "ls"):
            print(json.dumps([command, main([command, path])]), flush=True)
    """
)


def test_declared_sizes_beyond_the_stored_bytes_never_abort(
    forged: dict[str, Path], tmp_path: Path
) -> None:
    """Every forged size, both layouts, in one child process under a 4 GiB address-space
    limit: restore raises `CorruptCheckpointError`; ``info``, ``verify`` and ``ls`` say
    CORRUPT and exit 1; the process ends normally."""
    paths = list(forged.values())
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # -6: SIGABRT (std::bad_alloc)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 4 * len(paths), proc.stdout[-3000:]
    for case, start in zip(forged, range(0, len(rows), 4), strict=True):
        (_, restored), info, verify, ls = rows[start : start + 4]
        assert restored.startswith("CorruptCheckpointError"), (case, restored)
        assert info == ["info", 1] and verify == ["verify", 1] and ls == ["ls", 1], case
    assert "TiB" not in proc.stdout
    printed = proc.stdout
    assert "bytes are stored: no codec compresses" in printed  # the stored-bytes check
    assert "chunk(s) are stored" in printed  # the chunk-count check (plain directory)


@pytest.mark.parametrize("case", list(SIZES))
def test_info_flags_an_impossible_size(
    case: str, forged: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = forged[f"plain/{case}"]
    assert cli(["info", str(path)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "TiB" not in out, out
    with pytest.raises(ckptstore.CorruptCheckpointError):
        ckptstore.restore_sync(path)


@pytest.mark.parametrize("ocdbt", [False, True], ids=["plain", "ocdbt"])
def test_a_large_array_of_zeros_still_restores(
    ocdbt: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check admits what compresses best: all zeros, zstd's best case (~32768:1),
    with the threshold lowered so a 4 MiB array is checked."""
    monkeypatch.setattr(orbax, "CHECK_STORED_ABOVE", 1 << 20)
    tree = {"zeros": np.zeros(1 << 19), "w": np.arange(4.0)}
    orbax_save(tmp_path / "ckpt", tree, ocdbt)
    out = ckptstore.restore_sync(tmp_path / "ckpt")
    assert out["zeros"].shape == (1 << 19,) and not out["zeros"].any()
    assert cli(["info", str(tmp_path / "ckpt")]) == 0


@pytest.mark.parametrize("index", ["1" + "0" * 30, str(2**63), str(2**31), "3"])
def test_a_huge_sequence_index_is_a_typed_error(index: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    orbax_save(path, {"w": np.arange(4.0), "l": [np.ones(2), np.zeros(2)]}, ocdbt=False)
    meta = json.loads((path / "_METADATA").read_text())
    meta["tree_metadata"]["('l', '1')"]["key_metadata"][1]["key"] = index
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(ckptstore.CorruptCheckpointError, match="sequence index"):
        ckptstore.restore_sync(path)
    assert cli(["info", str(path)]) == 1


MEMORY_CHILD = textwrap.dedent(
    """
    import resource, sys
    limit = 4 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import ckptstore
    try:
        ckptstore.restore_sync(sys.argv[1])
        print("restore: no error")
    except ckptstore.CkptStoreError as exc:
        print("restore:", type(exc).__name__, exc)
    """
)


def test_a_consistent_array_larger_than_memory_is_refused_typed(tmp_path: Path) -> None:
    """An array whose declared size its stored bytes can hold (8 GiB of zeros in 1024
    zstd chunks of 8 MiB, ~270 bytes each) but this process cannot map (a 4 GiB
    address-space limit): restore raises `InsufficientMemoryError` before TensorStore sizes
    the buffer, instead of aborting in its allocation."""
    path = tmp_path / "ckpt"
    orbax_save(path, {"w": np.arange(4.0), "v": np.arange(3)}, ocdbt=False)
    chunk = 1 << 20
    one = ts.open(
        {
            "driver": "zarr",
            "kvstore": f"file://{tmp_path / 'one'}/",
            "metadata": {"shape": [chunk], "chunks": [chunk], "dtype": "<f8"},
        },
        create=True,
    ).result()
    one[...].write(np.zeros(chunk)).result()
    stored = (tmp_path / "one" / "0").read_bytes()
    assert len(stored) * orbax.MAX_COMPRESSION > chunk * 8  # passes the stored-bytes check
    zarray = json.loads((path / "w" / ".zarray").read_text())
    zarray.update(
        shape=[1024 * chunk],
        chunks=[chunk],
        compressor=json.loads((tmp_path / "one" / ".zarray").read_text())["compressor"],
    )
    (path / "w" / ".zarray").write_text(json.dumps(zarray))
    (path / "w" / "0").unlink()
    for i in range(1024):
        (path / "w" / str(i)).write_bytes(stored)
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # -6: SIGABRT (std::bad_alloc)
    assert proc.stdout.startswith("restore: InsufficientMemoryError"), proc.stdout
    assert "8589934592-byte buffer" in proc.stdout and "(leaf 'w')" in proc.stdout


def _edit_zarray(path: Path, name: str, **fields: Any) -> None:
    zarray = path / name / ".zarray"
    doc = json.loads(zarray.read_text())
    doc.update(fields)
    zarray.write_text(json.dumps(doc))


#: .zarray edits that restored different data silently: id -> (fields, text of the error).
ZARRAY_EDITS: dict[str, tuple[dict[str, Any], str]] = {
    "order F": ({"order": "F"}, "has order 'F'"),
    "shape smaller than its chunks": ({"shape": [2, 3]}, r"chunks \[4, 3\] larger than"),
    "shape and chunks smaller than the shards": (
        {"shape": [2, 3], "chunks": [2, 3]},
        r"_METADATA records shards of \[4, 3\]",
    ),
}


@pytest.mark.parametrize("edit", list(ZARRAY_EDITS))
def test_an_edited_zarray_is_corrupt_not_different_data(edit: str, tmp_path: Path) -> None:
    """A jax.Array (its shard shape recorded in _METADATA) stored as plain zarr v2."""
    path = tmp_path / "ckpt"
    tree = {"m": jax.numpy.arange(12.0).reshape(4, 3)}
    orbax_save(path, tree, ocdbt=False)
    assert ckptstore.restore_sync(path)["m"].tolist() == np.arange(12.0).reshape(4, 3).tolist()
    fields, match = ZARRAY_EDITS[edit]
    _edit_zarray(path, "m", **fields)
    with pytest.raises(ckptstore.CorruptCheckpointError, match=match) as info:
        ckptstore.restore_sync(path)
    assert info.value.leaf == "m"
    assert cli(["info", str(path)]) == 1
