"""Incremental partial saves: every part records its digests (so a partially-saved step is
a base like any other), and a session opened with ``base=B`` references the leaves
unchanged since B rather than write them, with the safety rules of ``save(base=)``
(docs/incremental.md)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.errors import BaseStepGoneError, ConfigError
from ckptstore.format import layout
from ckptstore.format.manifest import Reference
from ckptstore.protocol import load_committed
from tests.checkpoint.helpers import FIXTURE_V1, FROZEN, assert_same, holders, lora, stored_bytes
from tests.conftest import make_backend
from tests.paths import committed_root

CHANGED = 64 * 16 * 4 * 2 + 8  # lora(k)'s adapters and step counter
HELD = FROZEN.nbytes + 7 * 4  # lora(k)'s frozen base


@pytest.fixture(params=["local", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b = await make_backend(request.param, request, tmp_path)
    async with b:
        yield b


async def partially(
    backend: Backend, tree: dict[str, Any], step: int, base: int | None = None
) -> ckptstore.SaveResult:
    """``tree`` saved as ``step`` in two parts: its frozen base, then the rest."""
    session = await ckptstore.partial_save(backend, step=step, base=base)
    await session.add({"base": tree["base"]})
    await session.add({"adapter": tree["adapter"], "step": tree["step"]})
    return await session.finalize()


async def test_a_partially_saved_step_serves_as_a_base(backend: Backend) -> None:
    await partially(backend, lora(1), step=1)
    manifest = await load_committed(backend, 1)
    assert set(manifest.items["state"].digests) == set(manifest.items["state"].leaves)
    result = await ckptstore.save(backend, lora(2), step=2, base=1)
    assert result.bytes_written == CHANGED and result.bytes_referenced == HELD
    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert (await ckptstore.verify(backend, 2)).ok


async def test_a_session_on_a_base_writes_only_what_changed(backend: Backend) -> None:
    await ckptstore.save(backend, lora(1), step=1)  # base/norm goes into a pack there
    session = await ckptstore.partial_save(backend, step=2, base=1)
    frozen = await session.add({"base": lora(2)["base"]})
    assert set(frozen.refs) == {"base/w", "base/norm"} and frozen.bytes_written == 0
    rest = await session.add({"adapter": lora(2)["adapter"], "step": 2})
    assert not rest.refs and rest.bytes_written == CHANGED
    result = await session.finalize()
    assert result.bytes_written == CHANGED and result.bytes_referenced == HELD
    assert await stored_bytes(backend, 2) < CHANGED + (64 << 10)

    step1 = await load_committed(backend, 1)
    manifest = await load_committed(backend, 2)
    item = manifest.items["state"]
    assert manifest.format_version == layout.REFERENCES_VERSION
    assert manifest.references == [Reference(1, step1.attempt)] and manifest.base
    assert set(item.refs) == {"base/w", "base/norm"}
    assert item.packed["base/norm"] == step1.items["state"].packed["base/norm"]  # its pack
    assert set(item.digests) == set(item.leaves)
    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert (await ckptstore.verify(backend, 2)).ok

    # On base 2: the frozen leaves point at step 1 (their holder, no chain), the unchanged
    # adapters at step 2, which wrote them.
    result = await partially(backend, lora(2), step=3, base=2)
    assert result.bytes_written == 0 and result.bytes_referenced == result.bytes
    step2 = await load_committed(backend, 2)
    assert await holders(backend, 3) == {(1, str(step1.attempt)), (2, str(step2.attempt))}
    assert_same(await ckptstore.restore(backend, 3), lora(2))
    assert (await ckptstore.verify(backend, 3)).ok


async def test_deleting_the_base_keeps_what_a_partially_saved_step_references(
    backend: Backend,
) -> None:
    await ckptstore.save(backend, lora(1), step=1)
    await partially(backend, lora(2), step=2, base=1)
    base_root = await committed_root(backend, 1)
    kept = len([o async for o in backend.list(base_root)])
    await ckptstore.delete_step(backend, 1)
    await ckptstore.gc(backend, older_than=0)  # a tiny grace: still referenced by step 2
    assert await ckptstore.list_steps(backend) == [2]
    assert len([o async for o in backend.list(base_root)]) == kept + 1  # + its DELETED record
    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert (await ckptstore.verify(backend, 2)).ok

    await ckptstore.delete_step(backend, 2)  # the last referrer: now gc frees the base
    removed = await ckptstore.gc(backend, older_than=0)
    assert base_root in removed.entries
    left = [o.key.rsplit("/", 1)[1] async for o in backend.list(base_root)]
    assert set(left) <= set(layout.TOMBSTONES)


async def test_a_base_gone_fails_the_session_typed_and_commits_nothing(backend: Backend) -> None:
    with pytest.raises(BaseStepGoneError):  # not committed: refused at open
        await ckptstore.partial_save(backend, step=2, base=1)
    assert [o async for o in backend.list("2")] == []

    await ckptstore.save(backend, lora(1), step=1)
    session = await ckptstore.partial_save(backend, step=2, base=1)
    await session.add({"base": lora(2)["base"]})  # referenced
    await ckptstore.delete_step(backend, 1)
    with pytest.raises(BaseStepGoneError):  # a part: nothing written
        await session.add({"adapter": lora(2)["adapter"], "step": 2})
    with pytest.raises(BaseStepGoneError):  # the commit's re-check
        await session.finalize()
    assert await ckptstore.list_steps(backend) == []

    # The base step saved again: another attempt, which the session did not read.
    await ckptstore.gc(backend, older_than=0)
    await ckptstore.save(backend, lora(1), step=1)
    session = await ckptstore.partial_save(backend, step=3, base=1)
    await session.add({"base": lora(3)["base"]})
    await ckptstore.delete_step(backend, 1)  # (no gc here: it would collect the session)
    await ckptstore.save(backend, lora(1), step=1)
    with pytest.raises(BaseStepGoneError, match="no longer committed as attempt"):
        await session.add({"adapter": lora(3)["adapter"], "step": 3})
    with pytest.raises(BaseStepGoneError):
        await session.finalize()
    assert await ckptstore.list_steps(backend) == [1]


async def test_a_base_deleted_after_the_commits_check_is_kept(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base goes after the finalize's re-check, before the marker: the deletion and a
    gc with no grace find the referencing manifest (in flight) and keep the base's bytes."""
    await ckptstore.save(backend, lora(1), step=1)
    create = backend.create

    async def deleting_first(key: str, data: bytes) -> None:
        if key == layout.commit_key(2):
            await ckptstore.delete_step(backend, 1)
            await ckptstore.gc(backend, older_than=0)
        await create(key, data)

    monkeypatch.setattr(backend, "create", deleting_first)
    await partially(backend, lora(2), step=2, base=1)
    assert await ckptstore.list_steps(backend) == [2]
    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert (await ckptstore.verify(backend, 2)).ok


async def test_a_session_resumes_with_its_own_base_only(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    await ckptstore.save(root, lora(1), step=1)
    await ckptstore.save(root, lora(1), step=5)
    session = await ckptstore.partial_save(root, step=2, base=1)
    await session.add({"base": lora(2)["base"]})
    await session.close()  # a crash: the part is recorded, the step not finalized
    for other in (None, 5):
        with pytest.raises(ConfigError, match="base=1"):
            await ckptstore.partial_save(root, step=2, base=other)
    session = await ckptstore.partial_save(root, step=2, base=1)
    assert [set(p.refs) for p in session.parts] == [{"base/w", "base/norm"}]
    await session.add({"adapter": lora(2)["adapter"], "step": 2})
    result = await session.finalize()
    assert result.bytes_written == CHANGED and result.bytes_referenced == HELD
    assert_same(await ckptstore.restore(root, 2), lora(2))


async def test_replacing_a_leaf_between_written_and_referenced(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    await ckptstore.save(root, lora(1), step=1)
    changed = FROZEN.copy()
    changed[7, 7] = -1
    session = await ckptstore.partial_save(root, step=2, base=1)
    await session.add({"base": {"w": changed, "norm": lora(1)["base"]["norm"]}})
    back = await session.add({"base": {"w": FROZEN}}, replace=True)  # as the base has it
    assert set(back.refs) == {"base/w"}
    await session.add({"adapter": lora(2)["adapter"], "step": 2})
    result = await session.finalize()
    assert result.bytes_referenced == HELD
    assert_same(await ckptstore.restore(root, 2), lora(2))
    assert (await ckptstore.verify(root, 2)).ok

    session = await ckptstore.partial_save(root, step=3, base=1)
    await session.add({"base": lora(3)["base"]})  # both referenced
    await session.add({"base": {"w": changed}}, replace=True)  # then written after all
    await session.add({"adapter": lora(3)["adapter"], "step": 3})
    result = await session.finalize()
    assert result.bytes_referenced == 7 * 4
    want = lora(3)
    want["base"]["w"] = changed
    assert_same(await ckptstore.restore(root, 3), want)
    marker = json.loads((tmp_path / "ckpt" / layout.commit_key(3)).read_text())
    manifest = json.loads(
        (tmp_path / "ckpt" / "3" / marker["attempt"] / "manifest.json").read_text()
    )
    assert set(manifest["items"]["state"]["refs"]) == {"base/norm"}
    assert (await ckptstore.verify(root, 3)).ok


async def test_on_tiers_a_session_references_the_fast_base_and_promotes(tmp_path: Path) -> None:
    tiered = ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=str(tmp_path / "durable"))
    await ckptstore.save(tiered, lora(1), step=1)
    await ckptstore.promote(tiered, step=1)
    session = await ckptstore.partial_save(tiered, step=3, base=1)  # on the fast tier
    frozen = await session.add({"base": lora(3)["base"]})
    assert set(frozen.refs) == {"base/w", "base/norm"}
    await session.add({"adapter": lora(3)["adapter"], "step": 3})
    result = await session.finalize()
    assert result.bytes_written == CHANGED and result.bytes_referenced == HELD
    (promoted,) = await ckptstore.promote(tiered, step=3)
    assert CHANGED <= promoted.bytes < CHANGED + (64 << 10)  # the base was durable already
    durable = str(tmp_path / "durable")
    assert_same(await ckptstore.restore(durable, 3), lora(3))  # the durable tier alone
    assert (await ckptstore.verify(durable, 3)).ok


async def test_a_format_v1_step_is_no_session_base(tmp_path: Path) -> None:
    """A format-version-1 step has no attempt a part could reference: the session is refused
    when it opens, typed, with no session record left (one naming a null attempt was
    written before, which every add and every resume then refused)."""
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE_V1, root)
    for _ in range(2):  # and again: nothing was left to resume
        with pytest.raises(BaseStepGoneError, match="format-version-1"):
            await ckptstore.partial_save(str(root), step=21, base=9)
    assert not (root / "21").exists() or not list((root / "21").rglob("SESSION.json"))
