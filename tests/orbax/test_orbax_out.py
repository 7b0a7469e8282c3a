"""Orbax out and import-orbax: ckptstore steps read by real Orbax 0.12.8, Orbax
checkpoints converted into committed ckptstore steps, and the CLI on both."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.errors import OrbaxExportError
from tests.conftest import make_backend
from tests.orbax.conftest import assert_bit_exact, mesh, orbax_save, saved_form, sharded


def tree_for_orbax() -> dict[str, Any]:
    """Every leaf kind and dtype family, nested in dicts, lists and tuples, with empties."""
    w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 7
    return {
        "params": {
            "w": sharded(w, P("x", "y")),
            "b": jnp.arange(16, dtype=jnp.bfloat16) / 3,
            "f8": np.linspace(-2, 2, 12).astype(ml_dtypes.float8_e4m3fn),
            "mask": np.array([True, False, True]),
            "i64": np.arange(5, dtype=np.int64) - 2,
        },
        "layers": [
            {"k": np.arange(6, dtype=np.int32).reshape(2, 3)},
            {"k": np.arange(6, 12, dtype=np.int32).reshape(2, 3)},
        ],
        "pair": (np.zeros((2, 2), np.float64), np.float16(1.5)),
        "step": 12,
        "lr": 0.25,
        "done": True,
        "none": None,
        "empty": {},
        "nothing": [],
    }


def as_numpy(tree: Any) -> Any:
    """Orbax's restore without a target, normalized: jax arrays as numpy arrays."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def check(got: Any, want: Any) -> None:
    """Bit-exact, same types and containers; jax arrays compared as numpy, dict keys sorted."""
    assert_bit_exact(as_numpy(got), as_numpy(want))


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file below ``root``: size and sha256 (to prove nothing changed)."""
    return {
        p.relative_to(root).as_posix(): (
            p.stat().st_size,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def abstract_on(tree: Any, spec_of: dict[str, P]) -> dict[str, Any]:
    m = mesh((2, 4), ("a", "b"))
    return {
        name: jax.ShapeDtypeStruct(
            np.shape(x), np.asarray(x).dtype, sharding=NamedSharding(m, spec_of[name])
        )
        for name, x in tree.items()
    }


# ---- ckptstore -> Orbax ----


def test_standard_checkpointer_restores_an_export_like_its_own(tmp_path: Path) -> None:
    tree = tree_for_orbax()
    ckptstore.save_sync(tmp_path / "cs", tree, step=5)
    before = snapshot(tmp_path / "cs")
    result = asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out"))
    assert result.step == 5 and result.path == str(tmp_path / "out")
    assert result.linked > 0 and result.copied == 0  # same filesystem: hard links, no bytes
    assert not list(tmp_path.glob("*orbax-checkpoint-tmp*"))
    # The export and Orbax's own save of the same tree restore to the same thing.
    orbax_save(tmp_path / "native", tree)
    exported = ocp.StandardCheckpointer().restore(tmp_path / "out")
    native = ocp.StandardCheckpointer().restore(tmp_path / "native")
    check(as_numpy(exported), as_numpy(native))
    check(
        as_numpy(exported),
        saved_form(tree) | {"pair": [np.zeros((2, 2)), np.array(1.5, np.float16)]},
    )
    # The source is untouched and still verifies, also once the export is gone.
    assert snapshot(tmp_path / "cs") == before
    for path in (tmp_path / "out").rglob("*"):
        path.unlink() if path.is_file() else None
    report = ckptstore.verify_sync(tmp_path / "cs", 5)
    assert report.ok and report.leaves == 12


@pytest.mark.parametrize("codecs", [None, "zstd:3", {"w": "zstd:1"}])
def test_orbax_restores_an_export_onto_another_mesh(tmp_path: Path, codecs: Any) -> None:
    """Also of compressed steps: big leaves' zstd chunks referenced as they are, packed
    ones written out as zarr3 arrays with the same codec."""
    tree = {
        "w": sharded(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), P("x", "y")),
        "b": jnp.arange(16, dtype=jnp.bfloat16),
        "k": np.arange(24, dtype=np.int32).reshape(4, 6),
        "big": np.zeros((1024, 1100), np.float32),  # more than 4 MiB: not packed
    }
    ckptstore.save_sync(tmp_path / "cs", tree, step=1, codecs=codecs)
    asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out", link=False))
    if codecs is not None:  # what Orbax is handed really is compressed
        exported = sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())
        assert (exported < tree["big"].nbytes // 10) == (codecs == "zstd:3")
    target = abstract_on(
        tree, {"w": P("b", "a"), "b": P("b"), "k": P(None, "a"), "big": P("a", "b")}
    )
    out = ocp.StandardCheckpointer().restore(tmp_path / "out", target)
    for name, arr in out.items():
        assert isinstance(arr, jax.Array) and arr.sharding == target[name].sharding, name
        assert np.asarray(arr).tobytes() == np.asarray(tree[name]).tobytes(), name
    assert out["w"].addressable_shards[0].data.shape == (16, 8)


def test_checkpoint_manager_restores_exported_steps(tmp_path: Path) -> None:
    trees = {s: {"w": np.full((8, 4), s, np.float32), "n": s, "l": [np.arange(s)]} for s in (1, 2)}
    for s, tree in trees.items():
        ckptstore.save_sync(tmp_path / "cs", tree, step=s)
        r = asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "run", manager=True))
        assert r.step == s and r.path == str(tmp_path / "run" / str(s))
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        got = manager.restore(1)
        again = manager.restore(2, args=ocp.args.StandardRestore())
    check(as_numpy(got), saved_form(trees[1]))
    check(as_numpy(again), saved_form(trees[2]))
    # ckptstore's own Orbax reader sees the same root the same way.
    assert ckptstore.list_steps_sync(tmp_path / "run") == [1, 2]
    check(as_numpy(ckptstore.restore_sync(tmp_path / "run", step=1)), saved_form(trees[1]))


def test_export_refusals_write_nothing(tmp_path: Path) -> None:
    ckptstore.save_sync(tmp_path / "cs", {"a.b": np.zeros(2), "a": {"b": np.ones(2)}}, step=0)
    with pytest.raises(OrbaxExportError, match=r"'a\.b'"):
        asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    ckptstore.save_sync(tmp_path / "cs", {"x": np.zeros(2)}, step=1)
    asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out", step=1))
    with pytest.raises(ckptstore.AlreadyExistsError):
        asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out", step=1))
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "other", step=7))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cs", "out"]


async def test_export_from_and_to_object_storage(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """S3 in, local out: streamed copies Orbax reads; local in, S3 out: commit_success last."""
    tree = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "n": 3, "l": [np.ones(3)]}
    async with await make_backend("s3", request, tmp_path) as s3:
        await ckptstore.save(s3, tree, step=3)
        r = await ckptstore.export_orbax(s3, tmp_path / "out")
        assert r.linked == 0 and r.copied > 0 and r.copied_bytes >= tree["w"].nbytes
        got = await asyncio.to_thread(ocp.StandardCheckpointer().restore, tmp_path / "out")
        check(as_numpy(got), saved_form(tree))

        ckptstore.save_sync(tmp_path / "local", tree, step=4)
        await s3.delete_prefix("3")
        r = await ckptstore.export_orbax(tmp_path / "local", s3, manager=True)
        assert r.copied > 0 and await s3.exists("4/commit_success.txt")
        assert await ckptstore.list_steps(s3) == [4]  # finalized Orbax step, read in place
        check(await ckptstore.restore(s3), saved_form(tree))
        with pytest.raises(ckptstore.AlreadyExistsError):
            await ckptstore.export_orbax(tmp_path / "local", s3, manager=True)
        # And back: the Orbax step on S3 imported into a local ckptstore root.
        r2 = await ckptstore.import_orbax(s3, tmp_path / "imported", step=4)
        assert r2.save.step == 4 and r2.source.endswith("/4")
        check(await ckptstore.restore(tmp_path / "imported"), saved_form(tree))


def lora_for_orbax(k: int) -> dict[str, Any]:
    """A frozen base (a sharded matrix, a small leaf packed with others) and adapters that
    change with k: an incremental save of step k references the base."""
    frozen = np.arange(256 * 64, dtype=np.float32).reshape(256, 64) / 3
    return {
        "base": {"w": sharded(frozen, P("x", "y")), "norm": np.linspace(0, 1, 7, np.float32)},
        "adapter": {"a": np.full((64, 8), k, np.float32), "b": jnp.full((8,), -k, jnp.bfloat16)},
        "step": k,
    }


def test_an_incremental_step_exports_materialized(tmp_path: Path) -> None:
    """Step 2 references step 1's base (deleted meanwhile: its bytes stay for step 2): the
    export hard-links the holder's stores beside the step's own and Orbax restores it
    bit-exact, on its own and as a CheckpointManager step next to step 1."""
    ckptstore.save_sync(tmp_path / "cs", lora_for_orbax(1), step=1)
    saved = ckptstore.save_sync(tmp_path / "cs", lora_for_orbax(2), step=2, base=1)
    assert saved.bytes_referenced >= 256 * 64 * 4
    asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "run", step=1, manager=True))
    ckptstore.delete_step_sync(tmp_path / "cs", 1)
    before = snapshot(tmp_path / "cs")
    result = asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out", step=2))
    assert result.linked > 0 and result.copied == 0  # the holder's files too: links only
    assert sorted(p.name for p in (tmp_path / "out").glob("ckptstore.*")) == [
        "ckptstore.state",
        "ckptstore.state.held-0",
    ]
    exported = ocp.StandardCheckpointer().restore(tmp_path / "out")
    check(as_numpy(exported), saved_form(lora_for_orbax(2)))
    assert snapshot(tmp_path / "cs") == before  # the source is untouched
    asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "run", step=2, manager=True))
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        assert manager.all_steps() == [1, 2]
        for step in (1, 2):
            check(as_numpy(manager.restore(step)), saved_form(lora_for_orbax(step)))


async def test_an_incremental_step_on_object_storage_exports_by_copy(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """From S3: the holder's objects are copied (once each) beside the step's own."""
    async with await make_backend("s3", request, tmp_path) as s3:
        await ckptstore.save(s3, lora_for_orbax(1), step=1)
        await ckptstore.save(s3, lora_for_orbax(2), step=2, base=1)
        r = await ckptstore.export_orbax(s3, tmp_path / "out", step=2)
        assert r.linked == 0 and r.copied_bytes >= 256 * 64 * 4
        got = await asyncio.to_thread(ocp.StandardCheckpointer().restore, tmp_path / "out")
        check(as_numpy(got), saved_form(lora_for_orbax(2)))


# ---- Orbax -> ckptstore ----


def test_import_orbax_bit_exact_in_bounded_parts(tmp_path: Path) -> None:
    tree = tree_for_orbax()
    orbax_save(tmp_path / "orbax", tree)
    result = asyncio.run(
        ckptstore.import_orbax(tmp_path / "orbax", tmp_path / "cs", batch_bytes=64)
    )
    assert result.save.step == 0 and result.leaves == 12 and result.parts > 5
    assert ckptstore.list_steps_sync(tmp_path / "cs") == [0]
    assert ckptstore.verify_sync(tmp_path / "cs", 0).ok
    manifest = asyncio.run(ckptstore.read_manifest(tmp_path / "cs"))
    assert manifest.metadata["format"] == "orbax"
    imported = ckptstore.restore_sync(tmp_path / "cs", step=0)
    in_place = ckptstore.restore_sync(tmp_path / "orbax")
    check(imported, in_place)  # lists stay lists, scalars stay Python numbers
    # Onto another mesh, from the imported step.
    # The 32-bit and narrower leaves (jax without x64 would narrow int64).
    narrow = {k: v for k, v in tree["params"].items() if k != "i64"}
    specs = {"w": P("b", "a"), "b": P("b"), "f8": P("b"), "mask": P()}
    target = abstract_on(narrow, specs)
    out = ckptstore.restore_sync(tmp_path / "cs", like={"params": target}, partial=True)
    for name, arr in out["params"].items():
        assert arr.sharding == target[name].sharding
        assert np.asarray(arr).tobytes() == np.asarray(tree["params"][name]).tobytes(), name
    with pytest.raises(ckptstore.AlreadyExistsError):
        asyncio.run(ckptstore.import_orbax(tmp_path / "orbax", tmp_path / "cs"))


def test_import_a_manager_step_and_item(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ocp.CheckpointManager(root, item_names=("params", "extra")) as manager:
        for s in (1, 2):
            args = ocp.args.Composite(
                params=ocp.args.StandardSave({"w": np.full(4, s, np.float32)}),
                extra=ocp.args.StandardSave({"e": np.arange(s + 1)}),
            )
            manager.save(s, args=args)
        manager.wait_until_finished()
    with pytest.raises(ckptstore.CheckpointNotFoundError, match=r"\[.extra., .params.\]"):
        asyncio.run(ckptstore.import_orbax(root, tmp_path / "cs", item="state"))
    r = asyncio.run(ckptstore.import_orbax(root, tmp_path / "cs", step=1, item="extra"))
    assert r.save.step == 1 and r.source.endswith("/run/1") and r.items == {"extra": "extra"}
    check(ckptstore.restore_sync(tmp_path / "cs", step=1, item="extra"), {"e": np.arange(2)})
    asyncio.run(ckptstore.import_orbax(root, tmp_path / "cs", item="params", as_step=9))
    asyncio.run(ckptstore.import_orbax(root, tmp_path / "cs", as_step=10))  # every item
    assert ckptstore.list_steps_sync(tmp_path / "cs") == [1, 9, 10]
    for step in (9, 10):
        got = ckptstore.restore_sync(tmp_path / "cs", step=step, item="params")
        check(got, {"w": np.full(4, 2.0, np.float32)})
    check(ckptstore.restore_sync(tmp_path / "cs", step=10, item="extra"), {"e": np.arange(3)})


# ---- the command line ----


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_import_orbax_stores_leaves_as_codecs_and_casts_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptstore.cli import main

    tree = {"w": np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 7, "k": np.arange(6)}
    orbax_save(tmp_path / "orbax", tree)
    casts = {"w": "bfloat16"}
    asyncio.run(
        ckptstore.import_orbax(tmp_path / "orbax", tmp_path / "cs", codecs="zstd:3", casts=casts)
    )
    leaves = ckptstore.read_manifest_sync(tmp_path / "cs").items["state"].leaves
    assert [str(leaves[n].codec) for n in ("w", "k")] == ["zstd:3", "zstd:3"]
    assert (leaves["w"].dtype, leaves["w"].cast_from) == ("bfloat16", "float32")
    got = ckptstore.restore_sync(tmp_path / "cs")
    assert got["w"].tobytes() == tree["w"].astype(ml_dtypes.bfloat16).astype(np.float32).tobytes()
    assert got["k"].tobytes() == tree["k"].tobytes()
    flags = ["--codec", "k=none", "--codec", "zstd:1", "--no-progress"]
    assert main(["import-orbax", str(tmp_path / "orbax"), str(tmp_path / "cli"), *flags]) == 0
    leaves = ckptstore.read_manifest_sync(tmp_path / "cli").items["state"].leaves
    assert (str(leaves["w"].codec), leaves["k"].codec) == ("zstd:1", None)
    capsys.readouterr()
    bad = ["import-orbax", str(tmp_path / "orbax"), str(tmp_path / "bad"), "--codec", "zip"]
    assert main(bad) == 2 and "--codec" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_cli_on_orbax_checkpoints_and_both_directions(tmp_path: Path) -> None:
    root = tmp_path / "run"
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": 7}
    with ocp.CheckpointManager(root) as manager:
        manager.save(7, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    ls = cli("ls", root)
    assert ls.returncode == 0, ls.stderr
    assert "Orbax CheckpointManager root" in ls.stdout and "no committed" not in ls.stdout
    assert json.loads(cli("ls", root, "--json").stdout)[0]["step"] == 7
    info = json.loads(cli("info", root, "--json").stdout)
    assert info["items"]["default"]["w"] == {
        "shape": [3, 4],
        "dtype": "float32",
        "kind": "numpy",
        "bytes": 48,
    }
    ok = cli("verify", root)
    assert ok.returncode == 0 and "readable; 2 leaves, 56 B read" in ok.stdout, ok.stdout

    imported = cli("import-orbax", root, tmp_path / "cs", "--progress")  # stderr: a pipe
    assert imported.returncode == 0, imported.stderr
    assert "as step 7" in imported.stdout and "leaves 2/2" in imported.stderr  # progress
    again = cli("import-orbax", root, tmp_path / "cs")
    assert again.returncode == 2 and "already committed" in again.stderr
    check(ckptstore.restore_sync(tmp_path / "cs"), tree)

    exported = cli("export-orbax", tmp_path / "cs", tmp_path / "back", "--no-progress")
    assert exported.returncode == 0 and "exported step 7" in exported.stdout, exported.stderr
    check(as_numpy(ocp.StandardCheckpointer().restore(tmp_path / "back")), tree)

    # Damage: a lost data file is reported by verify, with exit status 1.
    big = np.random.default_rng(0).random(1 << 15, dtype=np.float32)  # kept out of line
    orbax_save(tmp_path / "bad", {"w": big, "ok": np.arange(3)})
    files = sorted((tmp_path / "bad" / "ocdbt.process_0" / "d").iterdir())
    max(files, key=lambda f: f.stat().st_size).unlink()
    bad = cli("verify", tmp_path / "bad", "--json")
    report = json.loads(bad.stdout)
    assert bad.returncode == 1 and not report["ok"], bad.stdout
    assert list(report["problems"]) == ["(tree)/w"]


class Pair(NamedTuple):
    first: Any
    second: Any


def test_odd_keys_match_orbaxs_own_naming(tmp_path: Path) -> None:
    """Keys with slashes, int keys, named tuples: the export restores as Orbax's own save."""
    tree = {"a/b": np.arange(3), "ids": {7: np.ones(2, np.float32)}, "nt": Pair(np.zeros(2), 1.5)}
    ckptstore.save_sync(tmp_path / "cs", tree, step=0)
    asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out"))
    orbax_save(tmp_path / "native", tree)
    exported = ocp.StandardCheckpointer().restore(tmp_path / "out")
    check(exported, ocp.StandardCheckpointer().restore(tmp_path / "native"))
    assert exported["a/b"].tolist() == [0, 1, 2] and exported["ids"]["7"].dtype == np.float32


def test_damaged_source_fails_cleanly(tmp_path: Path) -> None:
    ckptstore.save_sync(tmp_path / "cs", {"w": np.arange(1 << 16, dtype=np.float32)}, step=0)
    data = [p for p in (tmp_path / "cs").rglob("ocdbt.process_0/*") if p.is_file()]  # packs
    for f in data:
        f.unlink()
    for link in (True, False):
        with pytest.raises(ckptstore.CorruptCheckpointError):
            asyncio.run(ckptstore.export_orbax(tmp_path / "cs", tmp_path / "out", link=link))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cs"]  # no half export left


def test_format_v1_steps_export(tmp_path: Path) -> None:
    """Version-1 steps record no parts: their whole item directory is exported."""
    shutil.copytree(Path(__file__).parents[1].joinpath("fixtures") / "v1", tmp_path / "v1")
    for step in (7, 9):
        asyncio.run(ckptstore.export_orbax(tmp_path / "v1", tmp_path / f"out{step}", step=step))
        got = ocp.StandardCheckpointer().restore(tmp_path / f"out{step}")
        want = ckptstore.restore_sync(tmp_path / "v1", step=step)
        if step == 7:  # a Python complex is a 0-d array for Orbax (its scalars have none)
            assert got["pair"][1][1].shape == () and got["pair"][1][1] == 2j
            got["pair"][1][1] = complex(got["pair"][1][1])
            want["pair"] = list(want["pair"])
        check(got, want)
