"""An incremental save takes its base's manifest from `RecentCommits` when this process
committed it and the step's marker still names that attempt; everything else reads the
stored manifest (ckptstore.protocol)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import RECENT, RecentCommits, load_committed
from ckptstore.protocol import attempt as attempt_module
from tests.checkpoint.helpers import resign


@pytest.fixture
def manifest_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of every manifest this test reads from a local backend."""
    reads: list[str] = []
    real = LocalBackend.read

    async def read(self: LocalBackend, key: str, *args: Any, **kwargs: Any) -> bytes:
        if key.endswith("manifest.json"):
            reads.append(key)
        return await real(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "read", read)
    return reads


def tree(value: float) -> dict[str, Any]:
    return {"w": np.full((64, 64), value, np.float32), "b": np.arange(8.0)}


def test_a_base_this_process_committed_is_not_read_again(
    tmp_path: Path, manifest_reads: list[str]
) -> None:
    root = str(tmp_path / "ckpt")
    first = ckptstore.save_sync(root, tree(1.0), step=1)
    assert manifest_reads == []
    second = ckptstore.save_sync(root, tree(1.0), step=2, base=1)
    assert manifest_reads == [] and second.bytes_written == 0
    restored = ckptstore.restore_sync(root, 2)  # a restore reads what is stored
    np.testing.assert_array_equal(restored["w"], tree(1.0)["w"])
    assert manifest_reads == [  # the step's, then its holder's (`checkpoint/holdercheck.py`)
        layout.AttemptDir(2, second.attempt).manifest,
        layout.AttemptDir(1, first.attempt).manifest,
    ]
    assert first.attempt != second.attempt


def test_a_base_saved_again_by_another_writer_is_read(
    tmp_path: Path, manifest_reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "ckpt")
    ckptstore.save_sync(root, tree(1.0), step=1)
    ckptstore.delete_step_sync(root, 1)
    with monkeypatch.context() as patched:  # another process's save: its manifest not kept
        patched.setattr(attempt_module, "RECENT", RecentCommits(size=0))
        other = ckptstore.save_sync(root, tree(2.0), step=1)
    saved = ckptstore.save_sync(root, tree(2.0), step=2, base=1)
    assert layout.AttemptDir(1, other.attempt).manifest in manifest_reads
    assert saved.bytes_written == 0  # compared with the other writer's digests, all equal
    np.testing.assert_array_equal(ckptstore.restore_sync(root, 2)["w"], tree(2.0)["w"])


async def test_only_an_incremental_base_takes_the_kept_manifest(tmp_path: Path) -> None:
    """A manifest edited after its commit is what verify and restore see; the base of a
    save (``recent=True``) is this process's own copy of what it committed."""
    root = tmp_path / "ckpt"
    saved = await ckptstore.save(str(root), tree(1.0), step=1)
    path = root / layout.AttemptDir(1, saved.attempt).manifest
    edited = path.read_bytes().replace(b'"step":1,', b'"step":1 ,')
    assert edited != path.read_bytes()
    path.write_bytes(edited)
    async with LocalBackend(root) as backend:
        with pytest.raises(CorruptCheckpointError, match="does not match the digest"):
            await load_committed(backend, 1)
        kept = await load_committed(backend, 1, recent=True)
    assert isinstance(kept, Manifest) and kept.attempt == saved.attempt


def test_recent_commits_keeps_the_last_few() -> None:
    recent = RecentCommits(size=2)
    manifests = [Manifest(step=s, items={}, attempt=f"a{s}") for s in range(3)]
    for m in manifests:
        recent.add(m, f"d{m.step}")
    assert recent.get(0, "a0", "d0") is None
    assert recent.get(1, "a1", "d1") is manifests[1] and recent.get(2, "a2", "d2") is manifests[2]
    assert recent.get(2, "a1", "d2") is None and recent.get(2, None, "d2") is None
    assert recent.get(2, "a2", "d1") is None and recent.get(2, "a2", None) is None
    assert RECENT.size >= 1


def test_recent_commits_stay_within_their_byte_budget() -> None:
    """Beyond ``budget`` encoded bytes the oldest go first; the last one stays, whatever
    its size."""
    recent = RecentCommits(size=8, budget=100)
    manifests = [Manifest(step=s, items={}, attempt=f"a{s}") for s in range(4)]
    for m in manifests[:3]:
        recent.add(m, f"d{m.step}", 40)
    assert recent.get(0, "a0", "d0") is None  # 120 bytes: the oldest dropped
    assert recent.get(1, "a1", "d1") is manifests[1] and recent.get(2, "a2", "d2") is manifests[2]
    recent.add(manifests[3], "d3", 500)
    assert recent.get(3, "a3", "d3") is manifests[3]
    assert recent.get(1, "a1", "d1") is None and recent.get(2, "a2", "d2") is None


async def test_a_manifest_rewritten_with_its_marker_signed_again_is_read(
    tmp_path: Path, manifest_reads: list[str]
) -> None:
    """The marker names the same attempt but the digest of other bytes (a forger's edit,
    or an older version's manifest a test stands in for): what is stored is read."""
    root = tmp_path / "ckpt"
    saved = await ckptstore.save(str(root), tree(1.0), step=1)
    key = layout.AttemptDir(1, saved.attempt).manifest
    edited = (root / key).read_bytes().replace(b'"step":1,', b'"step":1 ,')
    async with LocalBackend(root) as backend:
        await resign(backend, 1, edited)
        manifest_reads.clear()
        reread = await load_committed(backend, 1, recent=True)
    assert manifest_reads == [key] and reread.attempt == saved.attempt
