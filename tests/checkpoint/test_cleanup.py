"""delete_step and gc: what they remove, what they never remove, and SIGKILL in the middle."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.stagedrecord import staged_key
from ckptstore.cli import main
from ckptstore.format import layout
from ckptstore.protocol import Marker, fates
from ckptstore.tiers import hostlocal
from tests.checkpoint.helpers import STALLS, Stalled, assert_is_tree, snapshot, tree_of
from tests.paths import attempts, committed_root


def data_only(snap: dict[str, bytes]) -> dict[str, bytes]:
    """A snapshot without fate and deletion records (a collected attempt's tombstone)."""
    return {k: v for k, v in snap.items() if k.rsplit("/", 1)[-1] not in layout.TOMBSTONES}


def claim_ttl_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if a day had passed: commit claims with no marker, and tombstones, expire."""
    monkeypatch.setattr(fates, "CLAIM_TTL", 0.0)


async def crashed_attempt(backend: Backend, step: int) -> layout.AttemptDir:
    """What a writer killed mid-save leaves: data and a manifest, no marker."""
    where = layout.AttemptDir(step, layout.new_attempt())
    await backend.write(f"{where.process_store('state', 0)}/d/junk", b"x" * 100)
    await backend.write(where.manifest, b"{}")
    return where


async def test_gc_keeps_committed_and_young_collects_the_rest(any_backend: Backend) -> None:
    await ckptstore.save(any_backend, tree_of(1), step=1)
    committed = await snapshot(any_backend, "1")
    dead = await crashed_attempt(any_backend, 1)
    orphan = await crashed_attempt(any_backend, 2)  # a step that never committed

    young = await ckptstore.gc(any_backend, older_than=3600)
    assert young.entries == [] and sorted(young.kept_young) == [dead.root, orphan.root]
    dry = await ckptstore.gc(any_backend, older_than=0, dry_run=True)
    assert sorted(dry.entries) == [dead.root, orphan.root] and dry.bytes > 200
    assert await any_backend.exists(dead.manifest)  # a dry run removes nothing

    removed = await ckptstore.gc(any_backend, older_than=0)
    assert sorted(removed.entries) == [dead.root, orphan.root] and removed.objects == 4
    assert not await any_backend.exists(dead.manifest)
    # byte for byte as before; the collected attempt's fate record stays, as a tombstone
    assert data_only(await snapshot(any_backend, "1")) == data_only(committed)
    assert await any_backend.exists(dead.fate) and await any_backend.exists(orphan.fate)
    assert_is_tree(await ckptstore.restore(any_backend, step=1), 1)
    assert (await ckptstore.gc(any_backend, older_than=0)).entries == []


async def test_gc_keeps_a_staged_step_on_a_host_local_fast_tier(tmp_path: Path) -> None:
    """What a multi-host save leaves on process 1's own fast tier (no COMMITTED: a STAGED
    marker and its part) is this host's part and its copy for a restart, not garbage."""
    fast = ckptstore.open_backend(str(tmp_path))
    part = await crashed_attempt(fast, 5)
    await hostlocal.stage(fast, 5, str(part.attempt), 1, 2, None, host_view=True)
    dead = await crashed_attempt(fast, 5)  # a save on this host that never staged
    removed = await ckptstore.gc(fast, older_than=0)
    assert removed.entries == [dead.root]
    assert await fast.exists(part.manifest) and await fast.exists(staged_key(5))
    (tmp_path / "5" / "STAGED").write_text("not json")  # unreadable: keep the whole step
    other = await crashed_attempt(fast, 5)
    assert (await ckptstore.gc(fast, older_than=0)).entries == []
    assert await fast.exists(other.manifest)
    await fast.close()


async def test_gc_uses_the_grace_period_by_age(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    await ckptstore.save(str(root), tree_of(1), step=1)
    backend = ckptstore.open_backend(str(root))
    dead = await crashed_attempt(backend, 1)
    assert (await ckptstore.gc(str(root))).kept_young == [dead.root]  # default: 6 h
    old = time.time() - 7 * 3600
    for path in (root / dead.root).rglob("*"):
        os.utime(path, (old, old))
    assert (await ckptstore.gc(str(root))).entries == [dead.root]


async def test_gc_never_collects_an_in_flight_save(any_backend: Backend) -> None:
    op, suffix, after = STALLS["merged"]
    gate = Stalled(any_backend, op, suffix, after=after)
    task = asyncio.create_task(ckptstore.save(gate, tree_of(7), step=3))
    await asyncio.wait_for(gate.reached.wait(), 60)  # all data written and merged, no marker
    removal = await ckptstore.gc(any_backend, older_than=60)
    assert removal.entries == [] and len(removal.kept_young) == 1
    gate.release.set()
    await task
    assert_is_tree(await ckptstore.restore(any_backend, step=3), 7)
    assert (await ckptstore.verify(any_backend, step=3)).ok


async def test_gc_removes_parts_a_committed_attempt_does_not_use(any_backend: Backend) -> None:
    session = await ckptstore.partial_save(any_backend, step=4)
    await session.add({"x": tree_of(4)["x"]})
    dropped = await session.add({"x2": np.zeros(3)})
    await session.add({"w": tree_of(4)["w"]})
    await session.drop(dropped.index)
    assert [p.index for p in session.parts] == [0, 2]
    await session.finalize()
    root = await committed_root(any_backend, 4)
    removal = await ckptstore.gc(any_backend, older_than=0)
    assert removal.entries == [f"{root}/state/{dropped.dir}"]
    restored = await ckptstore.restore(any_backend, step=4)
    assert sorted(restored) == ["w", "x"]
    assert_is_tree(restored, 4)


async def test_delete_step(any_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2, 3):
        await ckptstore.save(any_backend, tree_of(step), step=step)
    loser = await crashed_attempt(any_backend, 2)
    removal = await ckptstore.delete_step(any_backend, 2)
    root = await attempts(any_backend, 2)
    assert removal.entries[0] == "2/COMMITTED" and len(removal.entries) == 2
    assert root == [loser.attempt]  # only the committed attempt went; the other is gc's
    assert await ckptstore.list_steps(any_backend) == [1, 3]
    for step in (1, 3):
        assert_is_tree(await ckptstore.restore(any_backend, step=step), step)
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        await ckptstore.delete_step(any_backend, 2)
    assert (await ckptstore.gc(any_backend, older_than=0)).entries == [loser.root]
    left = [info.key async for info in any_backend.list("2")]
    assert left == ["2/REVOKED.0", loser.fate]  # the revocation, the loser's tombstone
    claim_ttl_over(monkeypatch)  # a day later, no stale deletion can name that commit
    expired = (await ckptstore.gc(any_backend, older_than=0)).entries
    assert sorted(expired) == ["2/REVOKED.0", loser.root]
    assert [info.key async for info in any_backend.list("2")] == []
    monkeypatch.undo()
    await ckptstore.save(any_backend, tree_of(5), step=2)
    assert_is_tree(await ckptstore.restore(any_backend, step=2), 5)


async def test_a_stale_delete_never_removes_the_step_saved_again(any_backend: Backend) -> None:
    """Two deletions of one step and a save of it committed between them: the slower
    deletion (it read the old marker before the first one ran) revokes only the commit it
    read, and the re-saved step stays, through gc too."""
    await ckptstore.save(any_backend, tree_of(1), step=1)
    stale = Stalled(any_backend, "create", "/DELETED")  # the marker read, about to act
    task = asyncio.create_task(ckptstore.delete_step(stale, 1))
    await asyncio.wait_for(stale.reached.wait(), 60)
    await ckptstore.delete_step(any_backend, 1)
    await ckptstore.save(any_backend, tree_of(2), step=1)
    stale.release.set()
    await task  # its goal holds: the commit it read is gone
    assert await ckptstore.list_steps(any_backend) == [1]
    await ckptstore.gc(any_backend, older_than=0)
    assert_is_tree(await ckptstore.restore(any_backend, step=1), 2)
    assert (await ckptstore.verify(any_backend, step=1)).ok
    await ckptstore.delete_step(any_backend, 1)  # the re-saved commit is deletable in turn
    assert await ckptstore.list_steps(any_backend) == []
    await ckptstore.save(any_backend, tree_of(3), step=1)
    assert_is_tree(await ckptstore.restore(any_backend, step=1), 3)


async def test_delete_step_with_an_unreadable_marker(
    any_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ckptstore.save(any_backend, tree_of(1), step=1)
    await any_backend.write("1/COMMITTED", b"garbage")
    with pytest.raises(ckptstore.CorruptCheckpointError):
        await ckptstore.gc(any_backend, older_than=0)  # cannot tell what it references
    assert (await ckptstore.delete_step(any_backend, 1)).entries == ["1/COMMITTED"]
    assert await ckptstore.list_steps(any_backend) == []
    # Its attempt was claimed for a commit: which marker named it, nobody can tell, so gc
    # keeps it for the claim's lifetime (a finalize could still be committing it).
    assert len((await ckptstore.gc(any_backend, older_than=0)).kept_young) == 1
    claim_ttl_over(monkeypatch)  # then it goes, and the revocation with it
    assert len((await ckptstore.gc(any_backend, older_than=0)).entries) == 2


KILLED_DELETE = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import ckptstore
    from ckptstore.backends.local import LocalBackend

    point = sys.argv[2]

    class DiesMidDelete(LocalBackend):
        async def _create(self, key, data):
            if point == "before marker" and "/REVOKED." in key:  # the commit's revocation
                os.kill(os.getpid(), signal.SIGKILL)
            await super()._create(key, data)

        async def _delete(self, key):
            await super()._delete(key)
            if point == "after marker" and key.endswith("COMMITTED"):
                os.kill(os.getpid(), signal.SIGKILL)

        async def _delete_prefix(self, prefix):
            if point == "mid attempt":  # remove some files of the attempt, then die
                files = sorted(p for p in self._path(prefix).rglob("*") if p.is_file())
                for path in files[: len(files) // 2]:
                    path.unlink()
                os.kill(os.getpid(), signal.SIGKILL)
            return await super()._delete_prefix(prefix)

    asyncio.run(ckptstore.delete_step(DiesMidDelete(sys.argv[1]), 2))
    """
)


@pytest.mark.parametrize("point", ["before marker", "after marker", "mid attempt"])
def test_delete_step_killed_leaves_the_step_intact_or_gone(tmp_path: Path, point: str) -> None:
    root = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        ckptstore.save_sync(root, tree_of(step), step=step)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_DELETE, root, point], timeout=120, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    steps = ckptstore.list_steps_sync(root)
    if point == "before marker":
        assert steps == [1, 2, 3]
        assert_is_tree(ckptstore.restore_sync(root, step=2), 2)
        assert ckptstore.verify_sync(root, step=2).ok
    else:
        assert steps == [1, 3]  # gone at once, though its files are (partly) still there
        assert any((Path(root) / "2").rglob("attempt-*"))
    assert main(["ls", root]) == 0
    removal = asyncio.run(ckptstore.gc(root, older_than=0))
    assert bool(removal.entries) == (point != "before marker")
    for step in ckptstore.list_steps_sync(root):
        assert_is_tree(ckptstore.restore_sync(root, step=step), step)


def test_cli_rm_gc_and_ls_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        ckptstore.save_sync(root, tree_of(step), step=step)
    backend = ckptstore.open_backend(root)
    dead = asyncio.run(crashed_attempt(backend, 2))
    one, two = (asyncio.run(committed_root(backend, s)).split("/")[1] for s in (1, 2))
    assert main(["ls", root, "--all"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    expected = [
        ("1", "committed", one),
        ("2", "committed", two),
        ("2", "uncommitted", dead.attempt),
    ]
    assert sorted((r[0], r[1], r[-1]) for r in rows) == sorted(expected)
    assert main(["gc", root, "--dry-run", "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {dead.root}" in out and "would remove 1 entry, 2 objects" in out
    assert main(["gc", root]) == 0  # default grace: too young
    assert f"kept {dead.root}" in capsys.readouterr().out
    assert main(["rm", root, "--step", "1"]) == 0
    assert "removed 1/COMMITTED" in capsys.readouterr().out
    assert ckptstore.list_steps_sync(root) == [2]
    assert main(["rm", root, "--step", "1"]) == 2
    assert "step 1 is not committed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["gc", root, "--older-than", "soon"])
    assert "not a duration: 'soon'" in capsys.readouterr().err


KILLED_AT_LINK = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import ckptstore
    import ckptstore.backends.local as local

    real_link = os.link

    def link(src, dst, *args, **kwargs):  # the marker's temporary file is written: die
        if str(dst).endswith("COMMITTED"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_link(src, dst, *args, **kwargs)

    local.os.link = link
    ckptstore.save_sync(sys.argv[1], {"x": np.arange(5)}, step=2)
    """
)


def test_gc_removes_the_temporary_file_of_a_commit_killed_midway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save_sync(str(root), tree_of(1), step=1)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_AT_LINK, str(root)], timeout=120, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (temporary,) = (root / "2").glob(".COMMITTED.ckptstore-tmp.*")  # beside no marker
    assert ckptstore.list_steps_sync(str(root)) == [1]
    assert asyncio.run(ckptstore.gc(str(root))).kept_young  # the attempt: too young
    assert temporary.exists()  # and the temporary file too
    dry = asyncio.run(ckptstore.gc(str(root), older_than=0, dry_run=True))
    assert f"2/{temporary.name}" in dry.entries and temporary.exists()
    # The attempt was claimed for its commit: gc keeps it for the claim's lifetime.
    removal = asyncio.run(ckptstore.gc(str(root), older_than=0))
    assert removal.entries == [f"2/{temporary.name}"] and len(removal.kept_young) == 1
    claim_ttl_over(monkeypatch)
    removal = asyncio.run(ckptstore.gc(str(root), older_than=0))
    assert len(removal.entries) == 1
    monkeypatch.undo()
    assert not [p for p in (root / "2").rglob("*") if p.is_file()]
    assert_is_tree(ckptstore.restore_sync(str(root), step=1), 1)
    ckptstore.save_sync(str(root), {"x": np.arange(5)}, step=2)  # and saved again
    assert ckptstore.list_steps_sync(str(root)) == [1, 2]


@pytest.mark.parametrize("actor", ["gc", "delete"])
async def test_a_step_deleted_between_its_marker_and_manifest_reads_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, actor: str
) -> None:
    """gc (or another deletion) that read step 1's marker and then finds its manifest gone,
    because a concurrent `delete_step` removed both meanwhile, carries on: the step is
    deleted, not corrupt (found by the kill campaign's race of a save, a deletion and gc)."""
    from ckptstore.checkpoint import cleanup

    root = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        await ckptstore.save(root, {"x": np.full(4, step, np.float32)}, step=step)
    real = cleanup.load_manifest
    raced: list[int] = []

    async def racing(backend: Backend, marker: Marker) -> object:
        if marker.step == 1 and not raced:  # the deletion runs between the two reads
            raced.append(1)
            await ckptstore.delete_step(root, 1)
        return await real(backend, marker)

    monkeypatch.setattr(cleanup, "load_manifest", racing)
    if actor == "gc":
        await ckptstore.gc(root, older_than=0)
    else:
        await ckptstore.delete_step(root, 3)
    assert raced and await ckptstore.list_steps(root) == ([2, 3] if actor == "gc" else [2])
    restored = await ckptstore.restore(root, step=2)
    assert restored["x"].tolist() == [2.0] * 4
