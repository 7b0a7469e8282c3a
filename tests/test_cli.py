"""The ckptstore command: ls, info, verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.cli import main


@pytest.fixture
def root(tmp_path: Path) -> str:
    path = str(tmp_path / "ckpt")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    tree = {
        "params": {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("x")))},
        "step": 7,
    }
    ckptstore.save_sync(path, tree, step=7)
    ckptstore.save_sync(path, {"only": np.zeros(1024, np.float32)}, step=9)
    return path


def test_ls(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "SIZE", "LEAVES"]
    assert [line.split()[0] for line in lines[1:]] == ["7", "9"]
    assert "4.0 KiB" in lines[2]


def test_ls_json_and_empty(root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["bytes"], r["leaves"]) for r in rows] == [(7, 136, 2), (9, 4096, 1)]
    (tmp_path / "empty").mkdir()
    assert main(["ls", str(tmp_path / "empty")]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out


def test_info(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", root, "--step", "7"]) == 0
    out = capsys.readouterr().out
    assert "step 7" in out
    w = next(line for line in out.splitlines() if "params/w" in line).split()
    assert w[1:4] == ["float32", "8x4", "128"]
    assert "P('x',)" in out and "mesh(x=4,y=2)" in out
    assert main(["info", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 9


def test_verify_catches_corruption(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", root, "--step", "9"]) == 0
    assert "step 9: intact; 1 leaf, 4.0 KiB read" in capsys.readouterr().out
    (attempt,) = (Path(root) / "9").glob("attempt-*")
    store = attempt / "state" / "ocdbt.process_0"  # its data files and packs
    victim = max((p for p in store.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 1
    victim.write_bytes(bytes(blob))
    assert main(["verify", root, "--step", "9"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT state/only" in out and "step 9: CORRUPT (1 problem)" in out


def test_errors_are_reported_not_raised(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", root, "--step", "8"]) == 2
    assert "step 8 is not committed" in capsys.readouterr().err
    assert main(["ls", "ftp://nowhere"]) == 2


def test_installed_command(root: str) -> None:
    exe = Path(sys.executable).with_name("ckptstore")
    proc = subprocess.run(
        [str(exe), "ls", root], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[0] == "7"


def test_ls_lists_a_corrupt_step_and_goes_on(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    (attempt,) = (Path(root) / "7").glob("attempt-*")
    manifest = attempt / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":7', b'"step":9'))
    assert main(["ls", root]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("         7  CORRUPT: manifest") and "digest" in lines[1]
    assert lines[2].split()[:2] == ["9", "4.0"]
    assert main(["verify", root, "--step", "7"]) == 1
    assert "CORRUPT 7/COMMITTED" in capsys.readouterr().out
