"""A `Tiered` target (or a `[tiers]` profile) accepted wherever a target is: save, restore,
list_steps, read_manifest, verify, partial_save, delete_step, gc and the CLI; durable tier on
moto S3 and fake-gcs-server."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.checkpoint.target import open_target
from ckptstore.cli import main
from tests.checkpoint.helpers import shared_target
from tests.paths import committed_root, largest_data_file
from tests.tiers.helpers import assert_tree, tree


@pytest.fixture(params=["s3", "gcs"])
def tiered(request: pytest.FixtureRequest, tmp_path: Path) -> ckptstore.Tiered:
    durable = shared_target(request.param, request, tmp_path, "durable")
    return ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=durable)


def damage_largest_data_file(fast: str, root: str) -> None:
    data = largest_data_file(Path(fast, root, "state"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data.write_bytes(bytes(blob))


async def test_every_entry_point_takes_tiers(tiered: ckptstore.Tiered) -> None:
    result = await ckptstore.save(tiered, tree(1), step=1)
    assert result.step == 1  # committed on the fast tier only: promotion is separate
    assert await ckptstore.list_steps(str(tiered.fast)) == [1]
    assert await ckptstore.list_steps(tiered.durable) == []
    assert await ckptstore.list_steps(tiered) == [1]
    assert_tree(await ckptstore.restore(tiered), 1)
    assert (await ckptstore.read_manifest(tiered)).attempt == result.attempt
    report = await ckptstore.verify(tiered)
    assert report.ok and report.tier == "fast" and report.leaves == 3
    with pytest.raises(ckptstore.AlreadyExistsError):
        await ckptstore.save(tiered, tree(1), step=1)

    await ckptstore.promote(tiered)
    await ckptstore.save(tiered, tree(2), step=2)
    async with await ckptstore.partial_save(tiered, step=3) as session:
        await session.add({"w": tree(3)["w"]})
        await session.add({"b": tree(3)["b"], "step": 3})
        await session.finalize()
    assert await ckptstore.list_steps(str(tiered.fast)) == [1, 2, 3]
    assert await ckptstore.list_steps(tiered.durable) == [1]
    assert ckptstore.list_steps_sync(tiered) == [1, 2, 3]
    assert_tree(ckptstore.restore_sync(tiered, step=3), 3)

    removal = await ckptstore.delete_step(tiered, 1)  # from both tiers
    assert any(e.endswith("1/COMMITTED") and "nvme" in e for e in removal.entries)
    assert await ckptstore.list_steps(tiered.durable) == []
    assert await ckptstore.list_steps(tiered) == [2, 3]
    with pytest.raises(ckptstore.CheckpointNotFoundError, match="neither tier"):
        await ckptstore.delete_step(tiered, 1)

    await ckptstore.promote(tiered)
    shutil.rmtree(tiered.fast)  # new machines: only the durable tier is left
    assert await ckptstore.list_steps(tiered) == [2, 3]
    assert_tree(await ckptstore.restore(tiered, step=2), 2)
    assert (await ckptstore.read_manifest(tiered)).step == 3
    report = await ckptstore.verify(tiered, step=2)
    assert report.ok and report.tier == "durable"
    assert (await ckptstore.gc(tiered, older_than=0)).entries == []


async def test_a_damaged_fast_copy_is_skipped_by_every_reader(
    tiered: ckptstore.Tiered, caplog: pytest.LogCaptureFixture
) -> None:
    await ckptstore.save(tiered, tree(4), step=4)
    await ckptstore.promote(tiered)
    fast = ckptstore.open_backend(tiered.fast)
    damage_largest_data_file(str(tiered.fast), await committed_root(fast, 4))
    assert not (await ckptstore.verify(tiered.fast)).ok
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert_tree(await ckptstore.restore(tiered), 4)
        report = await ckptstore.verify(tiered)
    assert "fast copy of step 4 is damaged" in caplog.text
    assert report.ok and report.tier == "durable"
    assert report.skipped and all(k.startswith(fast.url) for k in report.skipped)


async def test_damage_without_a_durable_copy_is_an_error_not_a_fallback(
    tmp_path: Path,
) -> None:
    tiers = ckptstore.Tiered(str(tmp_path / "nvme"), str(tmp_path / "bucket"))
    await ckptstore.save(tiers, tree(5), step=5)
    damage_largest_data_file(str(tiers.fast), await committed_root(open_target(tiers.fast), 5))
    with pytest.raises(ckptstore.CorruptCheckpointError):
        await ckptstore.restore(tiers)
    report = await ckptstore.verify(tiers)
    assert not report.ok and report.tier == "fast" and not report.skipped
    marker = tmp_path / "nvme" / "5" / "COMMITTED"
    doc = json.loads(marker.read_text())
    doc["manifest_digest"] = "sha256:" + "0" * 64
    marker.write_text(json.dumps(doc))
    with pytest.raises(ckptstore.CorruptCheckpointError, match="digest"):
        await ckptstore.read_manifest(tiers)


def tiers_profile(tmp_path: Path) -> Path:
    profile = tmp_path / "tiered.toml"
    profile.write_text('[tiers]\nfast = "nvme"\ndurable = "bucket"\nkeep_fast = 1\n')
    return profile


async def test_a_tiers_profile_is_a_target_too(tmp_path: Path) -> None:
    profile = tiers_profile(tmp_path)
    await ckptstore.save(str(profile), tree(6), step=6)
    assert await ckptstore.list_steps(str(tmp_path / "nvme")) == [6]
    assert_tree(await ckptstore.restore(profile), 6)
    assert ckptstore.Tiered.from_profile(profile).keep_fast == 1
    with pytest.raises(ckptstore.ConfigError, match="two tiers"):
        open_target(ckptstore.Tiered.from_profile(profile))


def test_cli_info_verify_rm_gc_on_a_tiers_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = str(tiers_profile(tmp_path))
    ckptstore.save_sync(profile, tree(7), step=7)
    assert main(["promote", profile, "--no-progress"]) == 0
    ckptstore.save_sync(profile, tree(8), step=8)
    capsys.readouterr()
    assert main(["info", profile, "--step", "7"]) == 0
    assert capsys.readouterr().out.startswith("step 7, created")
    assert main(["verify", profile]) == 0
    assert "step 8: intact on the fast tier" in capsys.readouterr().out
    assert main(["promote", profile, "--no-progress"]) == 0  # keep_fast=1: 7 leaves nvme
    capsys.readouterr()
    assert main(["verify", profile, "--step", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tier"] == "durable"
    stale = tmp_path / "bucket" / "7" / "attempt-20000101T000000-000000000000"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")  # an attempt that never committed
    assert main(["gc", profile, "--older-than", "0"]) == 0
    assert "bucket/7/attempt-20000101T000000-000000000000" in capsys.readouterr().out
    assert main(["rm", profile, "--step", "8"]) == 0
    out = capsys.readouterr().out
    assert "nvme/8/COMMITTED" in out and "bucket/8/COMMITTED" in out
    assert main(["ls", profile, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == {"7": "durable"}
    assert main(["ls", profile, "--all", "--json"]) == 0  # each tier's entries
    found = json.loads(capsys.readouterr().out)
    assert {(e["step"], e["state"]) for e in found["durable"]} >= {(7, "committed")}
    assert all(e["state"] != "committed" for e in found["fast"])  # 7 left it, 8 was removed


def test_numpy_leaves_restore_bit_exact_from_a_profile_twice(tmp_path: Path) -> None:
    """The blocking twins take tiers too (one private loop, backends opened per call)."""
    profile = str(tiers_profile(tmp_path))
    value = {"x": np.arange(10, dtype=np.float64)}
    ckptstore.save_sync(profile, value, step=1)
    for _ in range(2):
        out = ckptstore.restore_sync(profile)
        assert out["x"].tobytes() == value["x"].tobytes()
    assert ckptstore.verify_sync(profile, 1).tier == "fast"


@pytest.mark.parametrize("damage", ["delete", "truncate"])
async def test_a_partial_fast_copy_falls_back_too(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every file of the fast copy, deleted or truncated in turn: the restore is exact (from
    the durable tier when the fast copy fails), a tree mismatch is still the caller's error."""
    tiers = ckptstore.Tiered(str(tmp_path / "nvme"), str(tmp_path / "bucket"))
    await ckptstore.save(tiers, tree(9), step=9)
    await ckptstore.promote(tiers)
    files = [p for p in (tmp_path / "nvme" / "9").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"COMMITTED", "manifest.json", "pack-0"}
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        for path in files:
            original = path.read_bytes()
            if damage == "delete":
                path.unlink()
            else:
                path.write_bytes(original[: len(original) // 2])
            assert_tree(await ckptstore.restore(tiers), 9)
            path.write_bytes(original)
    assert "fast copy of step 9 is damaged" in caplog.text
    with pytest.raises(ckptstore.TreeMismatchError):
        await ckptstore.restore(tiers, like={"w": np.zeros((1, 1), np.float32)})
