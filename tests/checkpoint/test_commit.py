"""Commit protocol v2: attempts, the verified marker, racing and stalled writers, format v1."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.format import layout
from ckptstore.protocol import digest
from tests.checkpoint.helpers import (
    FIXTURE_V1,
    STALLS,
    Stalled,
    assert_is_tree,
    resign,
    snapshot,
    tree_of,
)
from tests.paths import attempts, committed_root

# ---- the layout ----


async def test_a_save_writes_only_below_its_attempt(any_backend: Backend) -> None:
    result = await ckptstore.save(any_backend, tree_of(1), step=3)
    assert layout.is_attempt(result.attempt)
    keys = [info.key async for info in any_backend.list()]
    outside = [k for k in keys if not k.startswith(f"3/{result.attempt}/")]
    assert outside == ["3/COMMITTED"]
    marker = json.loads(await any_backend.read("3/COMMITTED"))
    manifest = await any_backend.read(f"3/{result.attempt}/manifest.json")
    assert marker["attempt"] == result.attempt and marker["manifest_digest"] == digest(manifest)
    assert json.loads(manifest)["format_version"] == layout.PLAIN_VERSION == 3


async def test_steps_with_odd_names_are_not_listed(any_backend: Backend) -> None:
    await ckptstore.save(any_backend, tree_of(5), step=5)
    for name in ("05", "\u00b2", "\uff15", "5a"):  # leading zero, superscript 2, full-width 5
        await any_backend.write(f"{name}/COMMITTED", b"{}")
    assert await ckptstore.list_steps(any_backend) == [5]


# ---- readers verify before they trust ----


async def two_steps(backend: Backend) -> tuple[str, str]:
    await ckptstore.save(backend, tree_of(4), step=4)
    await ckptstore.save(backend, tree_of(5), step=5)
    return await committed_root(backend, 4), await committed_root(backend, 5)


async def expect_corrupt(backend: Backend, step: int, match: str) -> None:
    with pytest.raises(ckptstore.CorruptCheckpointError, match=match):
        await ckptstore.restore(backend, step=step)
    report = await ckptstore.verify(backend, step=step)
    assert not report.ok and match.split("|")[0].split(".")[0] in " ".join(report.problems.values())


async def test_manifest_edited_to_another_step_is_caught(any_backend: Backend) -> None:
    _, five = await two_steps(any_backend)
    doc = json.loads(await any_backend.read(f"{five}/manifest.json"))
    doc["step"] = 4
    edited = json.dumps(doc).encode()
    await any_backend.write(f"{five}/manifest.json", edited)
    await expect_corrupt(any_backend, 5, "digest")
    # Even with the digest in the marker fixed up, the manifest names the wrong step.
    marker = json.loads(await any_backend.read("5/COMMITTED"))
    marker["manifest_digest"] = digest(edited)
    await any_backend.write("5/COMMITTED", json.dumps(marker).encode())
    await expect_corrupt(any_backend, 5, "describes step 4")
    assert_is_tree(await ckptstore.restore(any_backend, step=4), 4)


async def test_marker_naming_another_steps_attempt_is_caught(any_backend: Backend) -> None:
    four, _ = await two_steps(any_backend)
    attempt4 = four.split("/")[1]
    marker = json.loads(await any_backend.read("5/COMMITTED"))
    marker["attempt"] = attempt4
    await any_backend.write("5/COMMITTED", json.dumps(marker).encode())
    await expect_corrupt(any_backend, 5, "missing")
    # Step 4's whole attempt copied under step 5, marker and digest consistent with it.
    for key, data in (await snapshot(any_backend, four)).items():
        await any_backend.write(key.replace("4/", "5/", 1), data)
    marker["manifest_digest"] = digest(await any_backend.read(f"5/{attempt4}/manifest.json"))
    await any_backend.write("5/COMMITTED", json.dumps(marker).encode())
    await expect_corrupt(any_backend, 5, "describes step 4")


@pytest.mark.parametrize(
    "marker",
    [b"", b"{not json", b"[]", b'{"step": 5, "attempt": "../4", "manifest_digest": "x"}'],
)
async def test_unreadable_marker_is_corrupt_not_missing(
    any_backend: Backend, marker: bytes
) -> None:
    await two_steps(any_backend)
    await any_backend.write("5/COMMITTED", marker)
    assert await ckptstore.list_steps(any_backend) == [4, 5]  # listed: a marker is there
    await expect_corrupt(any_backend, 5, "commit marker|names step|missing")


async def delete_chunk(backend: Backend, step: int, key: bytes) -> None:
    """Remove one chunk from the merged store's B-tree (its data file stays)."""
    root = await committed_root(backend, step)
    spec = {"driver": "ocdbt", "base": backend.kvstore_spec(f"{root}/state")}
    kv = await ts.KvStore.open(spec, context=backend.ts_context)
    assert (await kv.read(key)).state == "value"
    await kv.delete_range(ts.KvStore.KeyRange(key, key + b"\x00"))


async def test_missing_chunk_is_an_error_not_zeros(any_backend: Backend) -> None:
    await two_steps(any_backend)
    await delete_chunk(any_backend, 5, b"w/c/3")
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        await ckptstore.restore(any_backend, step=5)
    assert info.value.leaf == "w"
    report = await ckptstore.verify(any_backend, step=5)
    assert report.problems == {"state/w": "1 of 8 chunks missing (first: c/3)"}


# ---- racing and stalled writers ----


Writer = Callable[[Backend, int], Awaitable[Any]]


async def committed_bytes(backend: Backend, step: int) -> dict[str, bytes]:
    return await snapshot(backend, f"{step}/COMMITTED") | await snapshot(
        backend, await committed_root(backend, step)
    )


async def run_stalled(backend: Backend, stall: str, writer: Writer, order: str) -> None:
    """Two writers of step 5 pass their checks; one commits while the other is stalled.

    ``order`` "other commits meanwhile": the stalled writer waits while another save
    runs through and commits. "stalled commits first": both are stalled at the same
    point, the first is let go and commits, then the second.
    """
    op, suffix, after = STALLS[stall]
    first = Stalled(backend, op, suffix, after=after)
    task = asyncio.create_task(writer(first, 1))
    await asyncio.wait_for(first.reached.wait(), 60)
    if order == "other commits meanwhile":
        await ckptstore.save(backend, tree_of(2), step=5)
        winner, loser, gate = 2, task, first
    else:
        second = Stalled(backend, op, suffix, after=after)
        late = asyncio.create_task(writer(second, 2))
        await asyncio.wait_for(second.reached.wait(), 60)
        first.release.set()
        await task
        winner, loser, gate = 1, late, second
    before = await committed_bytes(backend, 5)
    gate.release.set()
    with pytest.raises(ckptstore.AlreadyExistsError):
        await loser
    assert await committed_bytes(backend, 5) == before  # the committed step: not a byte touched
    assert_is_tree(await ckptstore.restore(backend, step=5), winner)
    assert (await ckptstore.verify(backend, step=5)).ok
    assert len(await attempts(backend, 5)) == 2  # the loser's attempt is left for gc


ORDERS = ["other commits meanwhile", "stalled commits first"]


async def save_tree(backend: Backend, k: int) -> None:
    await ckptstore.save(backend, tree_of(k), step=5)


async def partial_tree(backend: Backend, k: int) -> None:
    session = await ckptstore.partial_save(backend, step=5, resume=False)
    await session.add({"x": tree_of(k)["x"]})
    await session.add({"w": tree_of(k)["w"]})
    await session.finalize()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("stall", list(STALLS))
async def test_stalled_save_never_touches_the_committed_step(
    any_backend: Backend, stall: str, order: str
) -> None:
    await run_stalled(any_backend, stall, save_tree, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("stall", list(STALLS))
async def test_stalled_partial_save_never_touches_the_committed_step(
    any_backend: Backend, stall: str, order: str
) -> None:
    await run_stalled(any_backend, stall, partial_tree, order)


async def test_concurrent_saves_in_one_process_one_wins(any_backend: Backend) -> None:
    outcomes = await asyncio.gather(
        *(ckptstore.save(any_backend, tree_of(k), step=6) for k in range(1, 5)),
        return_exceptions=True,
    )
    won = [k for k, o in enumerate(outcomes, 1) if isinstance(o, ckptstore.SaveResult)]
    lost = [o for o in outcomes if isinstance(o, ckptstore.AlreadyExistsError)]
    assert len(won) + len(lost) == 4, outcomes  # nothing but a win or a typed loss
    restored = await ckptstore.restore(any_backend, step=6)
    if any_backend.capabilities.conditional_create:
        assert len(won) == 1
        assert_is_tree(restored, won[0])
    else:  # fake-gcs-server ignores ifGenerationMatch=0: several creates may "win"
        assert won and int(restored["x"][0]) in won
        assert_is_tree(restored, int(restored["x"][0]))  # one whole tree, never a mix


# ---- format version 1 stays readable ----


@pytest.fixture
def v1_root(tmp_path: Path) -> Path:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE_V1, root)
    return root


async def test_format_v1_checkpoint_restores(v1_root: Path) -> None:
    assert await ckptstore.list_steps(str(v1_root)) == [7, 9]
    out = await ckptstore.restore(str(v1_root), step=7)
    np.testing.assert_array_equal(out["params"]["w"], np.arange(24, dtype=np.float32).reshape(4, 6))
    np.testing.assert_array_equal(out["params"]["b"], np.ones(3, np.int16))
    assert out["step"] == 7 and type(out["step"]) is int and out["lr"] == 0.5
    assert isinstance(out["pair"], tuple) and out["pair"][1] == [True, 2j]
    part = await ckptstore.restore(str(v1_root), step=9)
    np.testing.assert_array_equal(part["a"], np.full((2, 2), 3.0))
    np.testing.assert_array_equal(part["b"], np.arange(5, dtype=np.uint8))
    manifest = await ckptstore.read_manifest(str(v1_root), 7)
    assert manifest.format_version == 1 and manifest.attempt is None
    assert (await ckptstore.verify(str(v1_root), step=7)).ok
    assert (await ckptstore.verify(str(v1_root), step=9)).ok


async def test_format_v1_beside_v2_gc_and_delete(v1_root: Path) -> None:
    target = str(v1_root)
    await ckptstore.save(target, tree_of(1), step=10)
    assert (await ckptstore.gc(target, older_than=0)).entries == []  # v1 content is committed
    assert await ckptstore.list_steps(target) == [7, 9, 10]
    removal = await ckptstore.delete_step(target, 7)
    assert sorted(removal.entries) == ["7/COMMITTED", "7/manifest.json", "7/state"]
    assert await ckptstore.list_steps(target) == [9, 10]
    left = [p.name for p in (v1_root / "7").rglob("*") if p.is_file()]
    assert left == ["REVOKED.0"]  # the revocation of its commit: gc frees it after a day
    np.testing.assert_array_equal((await ckptstore.restore(target, step=9))["a"], 3.0)
    assert_is_tree(await ckptstore.restore(target), 1)


async def test_v1_tampering_is_still_caught(v1_root: Path) -> None:
    doc = json.loads((v1_root / "7" / "manifest.json").read_text())
    doc["step"] = 9
    (v1_root / "7" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ckptstore.CorruptCheckpointError, match="describes step 9"):
        await ckptstore.restore(str(v1_root), step=7)


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["items"]["state"]["leaves"]["x"].update(shape=[10**400]),
        lambda doc: doc.update(step=float("inf")),
        lambda doc: doc["items"]["state"].update(structure="NESTED"),
        lambda doc: doc["items"]["state"]["leaves"]["x"].update(dtype="float128"),
        lambda doc: doc["items"]["state"]["leaves"]["x"].update(python_type="str"),
        lambda doc: doc["items"].update({"../up": doc["items"]["state"]}),
    ],
    ids=["huge shape", "infinite step", "500 deep", "bad dtype", "bad python type", "bad item"],
)
async def test_hostile_manifests_are_corrupt_not_tracebacks(tmp_path: Path, edit: Any) -> None:
    """A manifest re-signed after a hostile edit still fails the reader's own checks."""
    root = str(tmp_path / "ckpt")
    await ckptstore.save(root, {"x": np.arange(4.0)}, step=1)
    backend = ckptstore.open_backend(root)
    where = await committed_root(backend, 1)
    doc = json.loads(await backend.read(f"{where}/manifest.json"))
    edit(doc)
    deep = '{"t":"list","items":[' * 500 + '{"t":"leaf","name":"x"}' + "]}" * 500
    await resign(backend, 1, json.dumps(doc).replace('"NESTED"', deep).encode())
    with pytest.raises(ckptstore.CorruptCheckpointError):
        await ckptstore.restore(root)
    assert not (await ckptstore.verify(root)).ok


async def test_numpy_scalar_leaves_restore_with_like(any_backend: Backend) -> None:
    tree = {"f": np.float64(1.5), "c": np.complex128(2 + 1j), "i": np.int32(3), "p": 2.5}
    await ckptstore.save(any_backend, tree, step=1)
    out = await ckptstore.restore(any_backend, like=tree)
    assert out == tree and all(type(out[k]) is type(v) for k, v in tree.items())
    plain = await ckptstore.restore(any_backend)  # without like: numpy scalars stay numpy
    assert plain == tree and all(type(plain[k]) is type(v) for k, v in tree.items())


async def test_numpy_scalars_recorded_as_python_numbers_earlier_still_restore(
    tmp_path: Path,
) -> None:
    """Before the fix, np.float64 leaves were recorded with python_type "float64"."""
    root = str(tmp_path / "ckpt")
    await ckptstore.save(root, {"f": np.float64(1.5), "g": 0.5}, step=1)
    backend = ckptstore.open_backend(root)
    where = await committed_root(backend, 1)
    doc = json.loads(await backend.read(f"{where}/manifest.json"))
    doc["items"]["state"]["leaves"]["f"]["python_type"] = "float64"  # as the old code wrote
    await resign(backend, 1, json.dumps(doc).encode())
    out = await ckptstore.restore(root)
    assert out == {"f": 1.5, "g": 0.5} and type(out["f"]) is np.float64 and type(out["g"]) is float
