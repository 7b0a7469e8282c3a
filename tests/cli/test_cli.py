"""The ckptstore command: ls, info, verify, rm."""

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
    assert lines[0].split()[:5] == ["STEP", "SIZE", "LEAVES", "WRITTEN", "REFERENCED"]
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


def test_ls_and_info_show_a_steps_json_items(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A configuration saved beside the arrays is an item of the step as much as they are."""
    root = str(tmp_path / "ckpt")
    config = {"lr": 0.001, "schedule": "cosine", "layers": [4, 8]}
    with ckptstore.CheckpointManager(
        root, options=ckptstore.ManagerOptions(handle_sigterm=False)
    ) as mgr:
        handle = mgr.save(3, items={"state": {"w": np.ones(4)}, "config": config}, force=True)
        assert handle is not None
        handle.wait()
    assert main(["ls", root]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "config,state"
    assert main(["ls", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["items"] == ["config", "state"]
    assert main(["info", root, "--step", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("item 'config': JSON")
    assert json.loads(out[at + 1]) == config


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


# ---- rm: several steps, ranges, --keep-latest, --dry-run, --json ----


@pytest.fixture
def run_root(tmp_path: Path) -> str:
    """Steps 1-6, 10 and 12 committed (tiny trees)."""
    path = str(tmp_path / "run")
    for step in (1, 2, 3, 4, 5, 6, 10, 12):
        ckptstore.save_sync(path, {"x": np.full(4, step, np.int32)}, step=step)
    return path


def rm_json(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 0) -> dict:
    assert main(["rm", *argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


def test_rm_removes_every_step_given(run_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rm", run_root, "--step", "2", "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "removed 2/COMMITTED" in out and "removed 3/COMMITTED" in out
    assert "removed 2 steps (2-3): 4 entries" in out
    assert "6 committed steps remain: 1, 4-6, 10, 12" in out
    assert ckptstore.list_steps_sync(run_root) == [1, 4, 5, 6, 10, 12]


def test_rm_ranges_take_the_committed_steps_inside(
    run_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = rm_json([run_root, "--step", "5-11", "--step", "1"], capsys)
    assert [s["step"] for s in doc["steps"]] == [1, 5, 6, 10]
    assert doc["dry_run"] is False and doc["remaining"] == [2, 3, 4, 12]
    assert all(s["objects"] > 1 and s["bytes"] > 0 for s in doc["steps"])
    assert doc["steps"][0]["entries"][0] == "1/COMMITTED"
    assert ckptstore.list_steps_sync(run_root) == [2, 3, 4, 12]
    doc = rm_json([run_root, "--step", "20-30"], capsys)  # nothing there: nothing to do
    assert doc["steps"] == [] and doc["remaining"] == [2, 3, 4, 12]
    assert main(["rm", run_root, "--step", "7-9"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_rm_keep_latest(run_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = rm_json([run_root, "--keep-latest", "3"], capsys)
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3, 4, 5]
    assert ckptstore.list_steps_sync(run_root) == [6, 10, 12]
    doc = rm_json([run_root, "--keep-latest", "5"], capsys)  # fewer than 5: none go
    assert doc["steps"] == [] and ckptstore.list_steps_sync(run_root) == [6, 10, 12]


def test_rm_dry_run_removes_nothing_and_says_what_would_go(
    run_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(str(p) for p in Path(run_root).rglob("*"))
    dry = rm_json([run_root, "--keep-latest", "2", "--dry-run"], capsys)
    assert sorted(str(p) for p in Path(run_root).rglob("*")) == before
    assert dry["dry_run"] is True and dry["remaining"] == [10, 12]
    assert main(["rm", run_root, "--step", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove 4/COMMITTED" in out and "would remove 1 step (4): 2 entries" in out
    assert "7 committed steps would remain: 1-3, 5-6, 10, 12" in out
    assert ckptstore.list_steps_sync(run_root) == [1, 2, 3, 4, 5, 6, 10, 12]
    real = rm_json([run_root, "--keep-latest", "2"], capsys)
    assert real["steps"] == dry["steps"]  # the dry run named exactly what went, byte for byte


def test_rm_refuses_a_missing_step_before_removing_any(
    run_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rm", run_root, "--step", "2", "--step", "7", "--step", "9"]) == 2
    assert "steps 7, 9 are not committed" in capsys.readouterr().err
    doc = rm_json([run_root, "--step", "8"], capsys, status=2)  # --json: the error as JSON
    assert doc["error"]["type"] == "CheckpointNotFoundError" and doc["error"]["exit"] == 2
    assert "step 8 is not committed" in doc["error"]["message"]
    assert ckptstore.list_steps_sync(run_root) == [1, 2, 3, 4, 5, 6, 10, 12]


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--step", "5-2"], "not a range of steps: '5-2'"),
        (["--step", "x"], "not a step or a range A-B: 'x'"),
        (["--keep-latest", "0"], "not a positive number: '0'"),
        (["--step", "1", "--keep-latest", "2"], "not allowed with argument"),
        ([], "one of the arguments --step --keep-latest is required"),
    ],
)
def test_rm_usage_errors(
    run_root: str, argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["rm", run_root, *argv])
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err
    assert ckptstore.list_steps_sync(run_root) == [1, 2, 3, 4, 5, 6, 10, 12]


def test_rm_of_several_steps_as_a_command(run_root: str) -> None:
    exe = Path(sys.executable).with_name("ckptstore")
    proc = subprocess.run(
        [str(exe), "rm", run_root, "--step", "28", "--step", "29"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
    )
    assert proc.returncode == 2 and "steps 28-29 are not committed" in proc.stderr
    proc = subprocess.run(
        [str(exe), "rm", run_root, "--step", "5", "--step", "6", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
    )
    assert proc.returncode == 0, proc.stderr
    assert [s["step"] for s in json.loads(proc.stdout)["steps"]] == [5, 6]
    assert ckptstore.list_steps_sync(run_root) == [1, 2, 3, 4, 10, 12]


def test_rm_on_a_tiers_profile_covers_both_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fast, durable = tmp_path / "nvme", tmp_path / "bucket"
    profile = tmp_path / "tiers.toml"
    profile.write_text(f'[tiers]\nfast = "{fast}"\ndurable = "{durable}"\n')
    tiers = ckptstore.Tiered(str(fast), str(durable))
    for step in (1, 2, 3):
        ckptstore.save_sync(tiers, {"x": np.full(4, step)}, step=step)
    ckptstore.promote_sync(tiers)
    ckptstore.save_sync(tiers, {"x": np.zeros(4)}, step=4)  # fast only, not promoted
    dry = rm_json([str(profile), "--keep-latest", "2", "--dry-run"], capsys)
    assert [s["step"] for s in dry["steps"]] == [1, 2] and dry["remaining"] == [3, 4]
    entries = dry["steps"][0]["entries"]  # named by URL: the step goes from both tiers
    assert f"{fast.as_uri()}/1/COMMITTED" in entries
    assert f"{durable.as_uri()}/1/COMMITTED" in entries and len(entries) == 4
    assert ckptstore.list_steps_sync(tiers) == [1, 2, 3, 4]
    real = rm_json([str(profile), "--keep-latest", "2"], capsys)
    assert real["steps"] == dry["steps"]
    assert ckptstore.list_steps_sync(str(fast)) == [3, 4]
    assert ckptstore.list_steps_sync(str(durable)) == [3]
