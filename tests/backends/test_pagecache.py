"""Written checkpoint files leave the page cache (checked with mincore)."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.pagecache import PageCacheEvictor

REPO = Path(__file__).resolve().parents[2]
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore on a mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        first = ctypes.c_char.from_buffer(m)  # copy-on-write mapping: unmodified pages are
        try:  # the page cache's own, so mincore reports their residency
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del first
        return sum(v & 1 for v in vec)


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on the project's disk: /tmp may be tmpfs, whose pages cannot be dropped."""
    scratch = Path(tempfile.mkdtemp(prefix=".pagecache-test-", dir=REPO))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch)


def data_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "/d/" in str(p)]


def test_save_leaves_no_data_in_the_page_cache(disk_dir: Path) -> None:
    tmp_path = disk_dir
    # 5 MiB: over the packs' limit, so TensorStore writes it (a pack is written O_DIRECT)
    tree = {"w": np.random.default_rng(0).standard_normal((1024, 1280)).astype(np.float32)}
    ckptstore.save_sync(LocalBackend(tmp_path / "dropped"), tree, step=1)
    ckptstore.save_sync(LocalBackend(tmp_path / "kept", drop_cache=False), tree, step=1)
    dropped = sum(resident_pages(p) for p in data_files(tmp_path / "dropped"))
    kept = sum(resident_pages(p) for p in data_files(tmp_path / "kept"))
    assert kept >= (4 << 20) // PAGE * 0.9  # the control: written data stays cached
    assert dropped < kept // 20
    restored = ckptstore.restore_sync(str(tmp_path / "dropped"))
    np.testing.assert_array_equal(restored["w"], tree["w"])


def test_evictor_sweeps_new_and_grown_files(disk_dir: Path) -> None:
    tmp_path = disk_dir
    (tmp_path / "a").write_bytes(os.urandom(1 << 20))
    os.sync()  # dirty pages are written back, not dropped: make them clean first
    evictor = PageCacheEvictor(tmp_path, interval=3600)  # sweeps only when asked
    evictor.sweep()
    assert resident_pages(tmp_path / "a") == 0
    with open(tmp_path / "a", "ab") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(os.urandom(1 << 20))
    os.sync()
    with evictor:
        pass  # the exit pass drops everything written meanwhile
    assert resident_pages(tmp_path / "a") == 0
    assert resident_pages(tmp_path / "sub" / "b") == 0


def test_write_behind_only_when_durable(tmp_path: Path) -> None:
    assert isinstance(LocalBackend(tmp_path).write_behind("x"), PageCacheEvictor)
    assert not isinstance(LocalBackend(tmp_path, fsync=False).write_behind("x"), PageCacheEvictor)
    off = LocalBackend(tmp_path, drop_cache=False).write_behind("x")
    assert not isinstance(off, PageCacheEvictor)
