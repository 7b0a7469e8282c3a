"""The benchmarks still run end to end (small, quick configurations)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.helpers import REPO, quick_run


def test_storage_benchmark_quick_run() -> None:
    # The default scratch directory: on the project's disk (dd oflag=direct needs a real one).
    out = quick_run("storage.py", timeout=180)
    assert "| backend | op" in out
    for backend in ("local", "memory", "s3", "gcs"):
        assert f"| {backend} " in out, out
    assert "floors:" in out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def test_small_leaves_benchmark_quick_run() -> None:
    out = quick_run("small_leaves.py", timeout=300)
    for writer in ("ocdbt_keys", "packs", "dd_direct"):
        assert f"| {writer} " in out, out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def run_report(*args: str) -> subprocess.CompletedProcess[str]:
    """``benchmarks/report.py ARGS``: draws the plots from recorded results, runs nothing."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "report.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_report_draws_every_plot_the_doc_shows(tmp_path: Path) -> None:
    # From the committed results: every figure docs/benchmarks.md links is drawn, as a PNG.
    proc = run_report("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    shown = set(re.findall(r"\]\(img/([\w.-]+\.png)\)", doc))
    drawn = {p.name for p in tmp_path.iterdir()}
    assert shown, "docs/benchmarks.md links no plot"
    assert shown <= drawn, f"linked but not drawn: {sorted(shown - drawn)}"
    assert drawn <= shown, f"drawn but not in the doc: {sorted(drawn - shown)}"
    for name in drawn:
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, name
    # ...and they are the ones committed in docs/img (regenerated with the results).
    committed = {p.name for p in (REPO / "docs" / "img").glob("*.png")}
    assert drawn == committed


def test_report_names_a_missing_results_file(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for src in (REPO / "benchmarks" / "results").glob("*.json"):
        if src.name != "tiered.json":
            (results / src.name).write_bytes(src.read_bytes())
    proc = run_report("--results", str(results), "--out", str(tmp_path / "img"))
    assert proc.returncode == 1
    assert "tiered.json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_scale_benchmark_quick_run() -> None:
    # P = 4 and 8 simulated processes on local disk: the real save, merge and commit.
    out = quick_run("scale.py", timeout=180)
    for count in (4, 8):
        assert re.search(rf"^\| local +\| {count} +\|", out, re.M), out
    assert re.search(r"every step restores bit-exact +\| True +\| PASS", out), out
    assert "KV messages (set, get) of a non-zero process" in out, out
    assert "floors: all PASS" in out, out  # bounded requests and messages per process
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def run_accelerator_dry(*args: str) -> str:
    """``benchmarks/accelerator.py --dry`` with ``args`` (no results written): its stdout,
    once it exited 0."""
    script = str(REPO / "benchmarks" / "accelerator.py")
    proc = subprocess.run(
        [sys.executable, script, "--dry", *args, "--no-write-results"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout


def test_accelerator_benchmark_dry_run() -> None:
    # The accelerator script's code paths on 8 CPU devices (device staging, times to
    # durable, peak RSS, restore onto the devices, Orbax side by side), so that an
    # accelerator machine's minutes go to running it.
    out = run_accelerator_dry()
    for row in ("pause_device", "durable_device", "rss_orbax", "restore_ckptstore"):
        assert f"| {row} " in out, out
    assert "| first_pause_vs_later " in out and "not judged on CPU devices" in out, out
    assert "floors: not judged on CPU devices" in out, out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def test_incremental_benchmark_quick_run() -> None:
    # Both trees through the manager, incremental vs full vs Orbax. The byte and disk floors
    # are exact at any size; the time floors (save, restore, promotion to a second local
    # directory) need the full 1 GiB run (fixed costs dominate a smoke run), so they are printed,
    # not asserted, here. 8 MiB and 3 steps (--quick alone: 32 MiB, 4): two later saves per
    # tree, each contender's, the restores and both promotions, as at any size.
    out = quick_run("incremental.py", "--mib", "8", "--steps", "3", timeout=300)
    for tree in ("lora", "third"):
        assert re.search(rf"^\| {tree} +\| bytes written / changed .*\| PASS", out, re.M), out
        assert re.search(rf"^\| {tree} +\| disk / \(base .*\| PASS", out, re.M), out
        assert re.search(rf"^\| {tree} +\| time to durable / Orbax ", out, re.M), out
        assert re.search(
            rf"^\| {tree} +\| promotion of the last step / full .*\| <= 0.2x", out, re.M
        ), out
    # The chunk-level scenario (an 8 MiB table, 3 later saves): its byte floor and its
    # restores (after the base is deleted and gc runs) hold at any size; its time floor
    # needs the 256 MiB table.
    assert re.search(r"^\| chunks +\| bytes written / table .*\| PASS", out, re.M), out
    assert re.search(r"^\| chunks +\| bit-exact restores.*\| PASS", out, re.M), out
    for saved in ("hashed", "declared rows"):
        assert re.search(rf"^\| chunks +\| time to durable / full save, {saved} ", out, re.M), out
    assert re.search(r"^\| chunks +\| a save of only the changed chunks / full ", out, re.M), out
    assert re.search(r"^\| chunks +\| the changed bytes stored raw, then", out, re.M), out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def test_declared_device_benchmark_quick_run(tmp_path: Path) -> None:
    # Its code paths on CPU devices (where nothing is copied, so its ratios mean nothing
    # here): each way of saving, each step, the restores of both declared roots.
    out = tmp_path / "declared_device.json"
    script = REPO / "benchmarks" / "declared_device.py"
    cmd = [sys.executable, str(script), "--mib", "8", "--steps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["restored_bit_exact"] is True
    assert {k: len(v) for k, v in got["seconds"].items()} == dict.fromkeys(
        ("bands", "whole", "full", "device_to_host"), 3
    )
    assert set(got["ratios"]) == {"bands_vs_whole", "bands_vs_full", "whole_vs_full"}


@pytest.mark.parametrize(
    ("where", "extra"),
    [("tmpfs", ["--profile", "--variants", ",nogc"]), ("disk", ["--parts", "loop,memory"])],
)
@pytest.mark.slow
def test_accelerator_loop_part_dry_run(where: str, extra: list[str]) -> None:
    # The loop part on CPU devices: four trees, every contender (none, ckptstore, Orbax, the
    # hardware's drain); in "tmpfs" the profile with a write-path variant, on "disk" the
    # memory part too (RSS over many saves, each library). Two runs: xdist runs them apart.
    out = run_accelerator_dry("--parts", "loop", "--loop-dirs", where, *extra)
    for tree in ("f64", "f256", "f1g", "llm"):
        for who in ("none", "ckptstore", "orbax", "drain"):
            assert re.search(rf"^\| {where} +\| {tree} +\| {who} +\|", out, re.M), out
        assert re.search(rf"^\| {where} +\| {tree} +\| lost_vs_drain +\|", out, re.M), out
    if where == "tmpfs":
        assert "profile ckptstore+nogc: lost/save" in out, out
    else:
        for who in ("ckptstore", "orbax"):  # the memory part: RSS over 12 saves each
            assert re.search(rf"^\| {who} +\| 12 +\|", out, re.M), out
    assert "floors: not judged on CPU devices" in out, out
    scratch = re.search(r"^scratch directory: (.+)$", out, re.M)
    assert scratch is not None and not Path(scratch.group(1)).exists()  # cleaned up


def test_accelerator_interference_part_dry_run() -> None:
    # The interference part on CPU devices: every kind of host load beside the steps, and
    # every writer of the host tree (two rounds), each a row with its figures.
    out = run_accelerator_dry("--parts", "interference")
    for kind in ("numpy copies", "os.pwrite", "pure-Python spin", "transfers", "fresh host"):
        row = rf"^host load: .*'load': '[^']*{kind}.*'median_ms': [0-9.]+"
        assert re.search(row, out, re.M), out
    for who in ("os.write", "TensorStore zarr3", "ckptstore.save_sync", "CheckpointManager"):
        rows = re.findall(rf"^writers: .*'who': '{who}.*'lost_s': [0-9.]+", out, re.M)
        assert len(rows) == 2, out
