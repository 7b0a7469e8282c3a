from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore.backends.local import LocalBackend
from ckptstore.errors import InvalidKeyError, NotFoundError, PermissionDeniedError
from ckptstore.testing.conformance import BackendTests, keys_of


class TestLocalBackend(BackendTests):
    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[LocalBackend]:
        async with LocalBackend(tmp_path / "root") as b:
            yield b


async def test_symlink_escape_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "link")
    backend = LocalBackend(root)
    for op in (
        backend.write("link/x", b"1"),
        backend.create("link/y", b"1"),
        backend.read("link/z"),
    ):
        with pytest.raises(InvalidKeyError):
            await op
    assert list(outside.iterdir()) == []


async def test_symlink_inside_root_allowed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    os.symlink(root / "real", root / "alias")
    backend = LocalBackend(root)
    await backend.write("alias/x", b"1")
    assert (root / "real" / "x").read_bytes() == b"1"


async def test_no_temporary_files_left_or_listed(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    await backend.write("a/b", os.urandom(5 << 20))
    await backend.create("a/c", b"x")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b", "c"]
    assert await keys_of(backend) == ["a/b", "a/c"]


@pytest.mark.parametrize("size", [4 << 20, (4 << 20) + 1, (16 << 20) + 4095, 40 << 20])
async def test_direct_io_sizes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    backend = LocalBackend(tmp_path)
    await backend.write("blob", data)
    assert (tmp_path / "blob").read_bytes() == data


async def test_gathered_write_crosses_the_staging_buffer(tmp_path: Path) -> None:
    # Unaligned parts whose sum passes the 16 MiB O_DIRECT staging buffer mid-part.
    rng = np.random.default_rng(1)
    parts = [rng.bytes(n) for n in (7 << 20, 4097, 9 << 20, 3, (1 << 20) + 11)]
    backend = LocalBackend(tmp_path)
    await backend.write_gather("blob", parts)
    assert (tmp_path / "blob").read_bytes() == b"".join(parts)
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]  # no temporary left


async def test_unsynced_mode_roundtrips(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, fsync=False)
    data = os.urandom(5 << 20)
    await backend.write("blob", data)
    assert await backend.read("blob") == data


async def test_directory_in_the_way(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    await backend.write("d/f", b"1")
    with pytest.raises(NotFoundError):
        await backend.read("d")


def test_os_errors_map_to_typed_errors(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    denied = backend._error(PermissionError(errno.EACCES, "Permission denied"), "ro/x")
    assert isinstance(denied, PermissionDeniedError)
    assert "ro/x" in str(denied) and str(tmp_path) in str(denied)
    assert isinstance(backend._error(OSError(errno.EROFS, "Read-only"), "k"), PermissionDeniedError)
    assert isinstance(backend._error(FileNotFoundError(errno.ENOENT, "x"), "k"), NotFoundError)


def test_kvstore_spec_points_at_root(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    assert backend.kvstore_spec("a/b") == {"driver": "file", "path": f"{tmp_path}/a/b/"}
    assert backend.kvstore_spec() == {"driver": "file", "path": f"{tmp_path}/"}


async def test_listing_skips_files_that_vanish_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concurrent writer's temporary file can be gone between readdir and stat."""
    backend = LocalBackend(tmp_path / "root")
    await backend.write("a/kept", b"1")
    await backend.write("a/gone", b"2")
    real_stat = os.stat

    def flaky_stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("gone"):
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", flaky_stat)
    assert [info.key async for info in backend.list("a")] == ["a/kept"]
    monkeypatch.undo()
    assert await backend.delete_prefix("a") == 2


async def test_every_directory_of_a_save_is_fsynced_before_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorStore creates most of a step's directories; each one (and the step's own
    entry in the root) is fsync'd before COMMITTED exists, so a power cut cannot keep the
    marker and lose a directory the checkpoint needs."""
    import numpy as np

    import ckptstore
    from ckptstore.backends import local

    synced: list[tuple[Path, bool]] = []
    fsync_dir = local.fsync_dir

    def record(directory: Path) -> None:
        synced.append((Path(directory), (tmp_path / "root" / "3" / "COMMITTED").exists()))
        fsync_dir(directory)

    monkeypatch.setattr(local, "fsync_dir", record)
    tree = {"a": {"w": np.arange(1000.0), "b": np.ones((4, 4), np.int32)}, "s": np.float32(2)}
    await ckptstore.save(str(tmp_path / "root"), tree, step=3)
    before = {d for d, committed in synced if not committed}
    step = tmp_path / "root" / "3"
    dirs = [Path(d) for d, _, _ in os.walk(step)]
    assert len(dirs) > 3  # the attempt, its item, ocdbt stores and their data directories
    assert {tmp_path / "root", *dirs} <= before, sorted(set(dirs) - before)


async def test_sync_dirs_without_fsync_does_nothing_and_a_missing_prefix_is_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.backends import local

    calls: list[Path] = []
    monkeypatch.setattr(local, "fsync_dir", calls.append)
    await LocalBackend(tmp_path, fsync=False).sync_dirs("")
    assert calls == []
    with pytest.raises(NotFoundError):
        await LocalBackend(tmp_path).sync_dirs("nope")
    (tmp_path / "a" / "b").mkdir(parents=True)
    await LocalBackend(tmp_path).sync_dirs("a")
    assert sorted(calls) == [tmp_path, tmp_path / "a", tmp_path / "a" / "b"]


async def test_sync_dirs_syncs_each_of_many_directories_once_and_raises_a_failed_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.backends import local

    calls: list[Path] = []
    real = local.fsync_dir

    def fsync(directory: Path) -> None:  # from several threads at once
        calls.append(directory)
        if directory.name == "broken":
            raise OSError(errno.EIO, "I/O error")
        real(directory)

    monkeypatch.setattr(local, "fsync_dir", fsync)
    many = [tmp_path / "a" / f"p{i}" / "d" for i in range(100)]
    for d in many:
        d.mkdir(parents=True)
    await LocalBackend(tmp_path).sync_dirs("a")
    expected = {tmp_path, tmp_path / "a", *many, *(d.parent for d in many)}
    assert sorted(calls) == sorted(expected)
    (tmp_path / "a" / "p7" / "broken").mkdir()
    with pytest.raises(OSError, match="I/O error"):
        await LocalBackend(tmp_path).sync_dirs("a")


async def test_read_into_more_buffers_than_one_system_call_takes(tmp_path: Path) -> None:
    data = os.urandom(5000)
    backend = LocalBackend(tmp_path)
    await backend.write("many", data)
    sizes = [1, 2, 0, 3] * 700  # 2,800 buffers: several preadv calls of at most IOV_MAX
    parts = [np.empty(n, np.uint8) for n in sizes]
    await backend.read_into("many", 11, [p.data for p in parts])
    assert b"".join(p.tobytes() for p in parts) == data[11 : 11 + sum(sizes)]
