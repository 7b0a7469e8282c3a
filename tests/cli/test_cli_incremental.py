"""The ckptstore command on incremental steps: ``ls`` and ``info`` show the bytes each step
wrote and the bytes it references; ``rm --dry-run`` keeps, as ``rm`` does, an attempt a
committed step references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import main

FROZEN = np.arange(1 << 16, dtype=np.float32)  # 256 KiB


def tree(k: int) -> dict[str, Any]:
    return {"frozen": FROZEN, "adapter": np.full(256, k, np.float32)}  # 1 KiB changes


@pytest.fixture
def root(tmp_path: Path) -> str:
    """Step 1 full, steps 2 and 3 on bases 1 and 2 (both reference step 1's attempt)."""
    path = str(tmp_path / "run")
    ckptstore.save_sync(path, tree(1), step=1)
    ckptstore.save_sync(path, tree(2), step=2, base=1)
    ckptstore.save_sync(path, tree(3), step=3, base=2)
    return path


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return json.loads(captured.out)


def disk_usage(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_ls_shows_bytes_written_and_referenced(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = run_json(["ls", root], capsys)
    got = [(r["step"], r["bytes_written"], r["bytes_referenced"], r["references"]) for r in rows]
    assert got == [
        (1, FROZEN.nbytes + 1024, 0, []),
        (2, 1024, FROZEN.nbytes, [1]),
        (3, 1024, FROZEN.nbytes, [1]),
    ]
    assert all(r["bytes"] == FROZEN.nbytes + 1024 for r in rows)

    assert main(["ls", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["STEP", "SIZE", "LEAVES", "WRITTEN", "REFERENCED"]
    step1, step3 = lines[1].split(), lines[3].split()
    assert step1[:8] == ["1", "257.0", "KiB", "2", "257.0", "KiB", "-", step1[7]]
    assert step3[:9] == ["3", "257.0", "KiB", "2", "1.0", "KiB", "256.0", "KiB", step3[8]]
    assert lines[3].endswith("(references step 1)") and "references" not in lines[1]


def test_info_shows_what_the_step_holds_and_what_it_reads(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", root, "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "written 1.0 KiB, referenced 256.0 KiB (base step 2)" in out
    attempt1 = ckptstore.read_manifest_sync(root, 1).attempt
    assert f"references step 1, attempt {attempt1}" in out
    frozen = next(line for line in out.splitlines() if line.strip().startswith("frozen"))
    adapter = next(line for line in out.splitlines() if line.strip().startswith("adapter"))
    assert frozen.endswith("(in step 1)") and "(in step" not in adapter

    doc = run_json(["info", root, "--step", "3"], capsys)
    assert (doc["bytes_written"], doc["bytes_referenced"]) == (1024, FROZEN.nbytes)
    assert doc["step"] == 3 and doc["references"] == [{"step": 1, "attempt": attempt1}]
    doc = run_json(["info", root, "--step", "1"], capsys)
    assert (doc["bytes_written"], doc["bytes_referenced"]) == (FROZEN.nbytes + 1024, 0)
    assert main(["info", root, "--step", "1"]) == 0
    assert "written 257.0 KiB, referenced 0 B\n" in capsys.readouterr().out


def test_rm_dry_run_keeps_a_referenced_attempt_as_rm_does(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dry = run_json(["rm", root, "--step", "1", "--dry-run"], capsys)
    (step,) = dry["steps"]
    attempt = f"1/{ckptstore.read_manifest_sync(root, 1).attempt}"
    assert step["entries"] == ["1/COMMITTED"] and step["objects"] == 1
    assert step["kept_referenced"] == [attempt]
    assert step["bytes"] == 0  # the marker only (counted by key): the attempt's bytes stay

    assert main(["rm", root, "--step", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would keep {attempt} (a committed step references it)" in out
    assert f"would remove {attempt}" not in out

    real = run_json(["rm", root, "--step", "1"], capsys)
    assert real["steps"] == dry["steps"] and real["remaining"] == [2, 3]
    assert disk_usage(Path(root) / "1") > FROZEN.nbytes  # step 1 is gone, its bytes stay
    assert ckptstore.list_steps_sync(root) == [2, 3]
    np.testing.assert_array_equal(ckptstore.restore_sync(root, 3)["frozen"], FROZEN)


def test_rm_dry_run_of_several_steps_counts_earlier_removals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 3 references step 5 (a base may be any committed step); ``rm --step 3-5``
    removes 3 first, so 5's attempt is no longer referenced when 5 goes: the dry run
    must say so too, and both must agree with the real removal."""
    root = str(tmp_path / "run")
    ckptstore.save_sync(root, tree(5), step=5)
    ckptstore.save_sync(root, tree(3), step=3, base=5)
    ckptstore.save_sync(root, tree(4), step=4)
    dry = run_json(["rm", root, "--step", "3-5", "--dry-run"], capsys)
    assert [s["kept_referenced"] for s in dry["steps"]] == [[], [], []]
    assert dry["steps"][2]["bytes"] > FROZEN.nbytes  # step 5's attempt is counted
    one = run_json(["rm", root, "--step", "5", "--dry-run"], capsys)
    assert one["steps"][0]["kept_referenced"] and one["steps"][0]["bytes"] == 0
    real = run_json(["rm", root, "--step", "3-5"], capsys)
    assert real["steps"] == dry["steps"] and real["remaining"] == []


def test_ls_all_marks_the_base_a_deleted_step_leaves_as_referenced(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 1 deleted: its attempt stays for steps 2 and 3, and ``ls --all`` says so
    ("referenced", base of 2, 3) instead of listing it as uncommitted, deletable."""
    ckptstore.delete_step_sync(root, 1)
    entries = run_json(["ls", root, "--all"], capsys)
    deleted, base = [e for e in entries if e["step"] == 1]  # its records, its attempt
    assert deleted["state"] == "deleted" and deleted["entry"] == "REVOKED.0"
    assert base["state"] == "referenced" and base["referenced_by"] == [2, 3]
    assert all(e["state"] == "committed" for e in entries if e["step"] != 1)
    assert main(["ls", root, "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "STATE", "STORED"]
    rows = [line for line in lines[1:] if line.split()[0] == "1"]
    assert rows[0].split()[1] == "deleted" and "the step was deleted" in rows[0]
    assert rows[1].split()[1] == "referenced" and rows[1].endswith("(base of 2, 3)")


def test_info_shows_chunks_held_by_other_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A leaf held in part (chunk references) says how many chunks which steps hold."""
    where = str(tmp_path / "chunks")
    table = np.arange(1024 * 64, dtype=np.float32).reshape(1024, 64)
    ckptstore.save_sync(where, {"emb": table}, step=1, chunk_bytes=4096)
    table[3] += 1  # 2 of its 64 chunks
    ckptstore.save_sync(where, {"emb": table}, step=2, base=1, chunk_bytes=4096)
    assert main(["info", where, "--step", "2"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("emb")]
    assert line.endswith("(62 chunks in steps 1)")
