"""A partial-save session that writes several items (and JSON items) of one step: they
commit together or not at all, and a resumed session finds every item's parts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import CheckpointNotFoundError, TreeError


def test_parts_of_several_items_and_json_items_commit_as_one_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    w, mu = np.arange(12, dtype=np.float32), np.ones(5, np.float64)

    async def first() -> None:
        async with await ckptstore.partial_save(root, 3, item="model") as session:
            await session.add({"w": w})
            await session.add({"mu": mu}, item="opt")
            # Killed here: nothing is committed, the parts stay for a resume.

    asyncio.run(first())
    assert ckptstore.list_steps_sync(root) == []
    with pytest.raises(CheckpointNotFoundError):
        ckptstore.restore_sync(root, step=3, item="model")

    async def resume() -> ckptstore.SaveResult:
        async with await ckptstore.partial_save(root, 3, item="model") as session:
            assert [(p.index, p.item) for p in session.parts] == [(0, "model"), (1, "opt")]
            assert set(session.leaves) == {"w"} and set(session.leaves_of("opt")) == {"mu"}
            await session.add({"b": np.int32(7)}, item="opt")
            with pytest.raises(TreeError, match="parts and JSON items"):
                await session.finalize(json_items={"opt": {"x": 1}})
            return await session.finalize(json_items={"config": {"lr": 0.5, "name": "a"}})

    result = asyncio.run(resume())
    assert result.bytes == w.nbytes + mu.nbytes + 4
    assert ckptstore.list_steps_sync(root) == [3]
    manifest = ckptstore.read_manifest_sync(root, 3)
    assert manifest.item_names == ["config", "model", "opt"]
    model = ckptstore.restore_sync(root, step=3, item="model")
    opt = ckptstore.restore_sync(root, step=3, item="opt")
    assert model["w"].tobytes() == w.tobytes()
    assert opt["mu"].tobytes() == mu.tobytes() and opt["b"] == 7
    assert ckptstore.restore_sync(root, step=3, item="config") == {"lr": 0.5, "name": "a"}
    assert ckptstore.verify_sync(root, 3).ok
