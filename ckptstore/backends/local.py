"""Local-disk backend: durable, atomically visible files under one root directory.

A write goes to a temporary file in the target directory, is fsync'd, renamed
over the key and the directory is fsync'd; `create` links the temporary file
to the key, which fails if the key exists (atomic create-if-absent). Large
writes bypass the page cache (``O_DIRECT``) so a durable write runs at the
disk's speed rather than at the speed of write-back. Every path is checked to
resolve inside the root, symlinks included.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import tensorstore as ts

from ckptstore.backends.base import Backend, Buffer, Capabilities, ObjectInfo
from ckptstore.backends.keys import TEMP_MARKER, join, validate_prefix
from ckptstore.backends.pagecache import PageCacheEvictor
from ckptstore.errors import (
    AlreadyExistsError,
    ConfigError,
    InsufficientSpaceError,
    InvalidKeyError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
)
from ckptstore.runtime.futures import finish_first, on_thread

_ALIGN = 4096
_DIRECT_MIN = 4 << 20  # below this, buffered write + fsync is as fast
_STAGE = 16 << 20  # aligned staging buffer for O_DIRECT writes
_staging = threading.local()
#: TensorStore writes each file with buffered writes and an fsync: more file I/O threads
#: than its default, max(4, cores), keep more of a save's fsyncs in flight.
_TS_FILE_IO_THREADS = 16

#: Directory fsyncs `LocalBackend.sync_dirs` keeps in flight. ext4 folds concurrent ones
#: into one journal commit: a 1,024-process save's attempt (~2,100 directories) syncs
#: several times faster with 8-32 at once than one after another.
_DIR_SYNCS = 16
_DIR_SYNCERS = concurrent.futures.ThreadPoolExecutor(_DIR_SYNCS, "ckptstore-dirsync")

#: Reads into caller buffers (`read_into`, the restore's data path) run on a few threads of
#: their own. More at once made the disk slower here, not faster: a 1 GiB cold restore read
#: as 64 MiB chunks was fastest with 2-3 reads at once, slower with 1 and with the default
#: executor's 6; each read also faults in its new buffer's pages, which one thread alone
#: cannot overlap with the disk.
_READERS = concurrent.futures.ThreadPoolExecutor(3, "ckptstore-read")


class LocalBackend(Backend):
    """Files under ``root`` on a POSIX filesystem.

    The root is created on the first write, unless ``create`` is false: then a missing root
    is a `ConfigError` here (say, an NVMe volume that is not mounted: writing on would fill
    the disk below the mount point).
    """

    kind = "local"
    capabilities = Capabilities(
        atomic_rename=True,
        conditional_create=True,
        server_side_copy=True,
        durable_writes=True,
        direct_reads=True,
    )

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = True,
        drop_cache: bool = True,
        create: bool = True,
        **options: Any,
    ):
        super().__init__(**options)
        self.root = Path(os.path.abspath(root))
        if not create and not self.root.is_dir():
            raise ConfigError(
                f"{self.root} does not exist (or is not a directory) and create = false "
                "refuses to create it: mount the volume or create the directory first"
            )
        self.fsync = fsync
        self.drop_cache = drop_cache
        self._real_root: str | None = None

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    @property
    def location(self) -> str:
        return f"file://{os.path.realpath(self.root)}"

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        norm = validate_prefix(prefix)
        path = self.root / norm if norm else self.root
        return {"driver": "file", "path": f"{path}/"}

    def _new_ts_context(self) -> ts.Context:
        """TensorStore's context for these files; its ``file_io_sync`` follows ``fsync``."""
        return ts.Context(
            {"file_io_concurrency": {"limit": _TS_FILE_IO_THREADS}, "file_io_sync": self.fsync}
        )

    def write_behind(self, prefix: str) -> contextlib.AbstractContextManager[object]:
        """Drop written files below ``prefix`` from the page cache (see `pagecache`).

        Only with ``fsync`` (written data goes to disk anyway) and ``drop_cache``.
        """
        if not (self.fsync and self.drop_cache):
            return contextlib.nullcontext()
        norm = validate_prefix(prefix)
        return PageCacheEvictor(self.root / norm if norm else self.root)

    async def free_bytes(self) -> int | None:
        """Free space for an unprivileged writer (``statvfs``) on the root's filesystem (on
        its nearest existing parent's while the root does not exist yet)."""
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        st = await aiofiles.os.statvfs(path)
        return int(st.f_bavail * st.f_frsize)

    # ---- paths ----

    def _path(self, key: str) -> Path:
        """The file for ``key``, refusing anything that resolves outside the root."""
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        path = self.root / key
        real = os.path.realpath(path)
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise InvalidKeyError(f"key {key!r} resolves outside the root of {self.url}")
        return path

    def _error(self, exc: OSError, key: str) -> StorageError:
        if exc.errno == errno.ENOENT:
            return NotFoundError("no such object", backend=self.url, key=key)
        if exc.errno == errno.EEXIST:
            return AlreadyExistsError("object already exists", backend=self.url, key=key)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            text = exc.strerror or "no space left"
            return InsufficientSpaceError(f"{text}: the storage is full", backend=self.url, key=key)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return PermissionDeniedError("permission denied", backend=self.url, key=key)
        if exc.errno == errno.EISDIR:
            return NotFoundError(
                "not an object (a directory is in the way)", backend=self.url, key=key
            )
        if exc.errno == errno.ENOTDIR:
            return NotFoundError(
                "a file is in the way where a directory should be", backend=self.url, key=key
            )
        return StorageError(f"{exc.strerror or exc}", backend=self.url, key=key)

    # ---- operations ----

    async def _check_root(self) -> None:
        if not await aiofiles.os.path.exists(self.root):
            raise NotFoundError(f"no such directory {self.root}", backend=self.url)
        if not await aiofiles.os.path.isdir(self.root):
            raise NotFoundError(f"{self.root} is not a directory", backend=self.url)

    async def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        def read() -> bytes:  # path, open, read, close: one hop to a worker, not four
            with open(self._path(key), "rb") as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                return f.read(max(0, end - (start or 0)))

        try:
            return await on_thread(None, read)
        except OSError as exc:
            raise self._error(exc, key) from exc

    async def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> int:
        try:
            # The path is resolved on the worker too: its lstat calls would each wait for
            # the GIL on the event loop's thread while other reads decode.
            def read() -> int:
                return _pread_into(self._path(key), offset, outs)

            return await on_thread(_READERS, read)
        except OSError as exc:
            raise self._error(exc, key) from exc

    async def _write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await self._put(key, [data], exclusive=False)

    async def _write_gather(self, key: str, parts: Sequence[Buffer]) -> None:
        await self._put(key, parts, exclusive=False)  # streamed: never joined in memory

    async def _create(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await self._put(key, [data], exclusive=True)

    async def _put(self, key: str, parts: Sequence[Buffer], *, exclusive: bool) -> None:
        def put() -> None:  # a cancellation still lets it finish (see `on_thread`)
            put_file(self._path(key), parts, exclusive=exclusive, fsync=self.fsync)

        try:
            await on_thread(None, put)
        except OSError as exc:
            raise self._error(exc, key) from exc

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix) if prefix else self.root
        if not prefix:
            await self._root_is_no_file()
        return await _walk(base, prefix)

    async def _list_dir(self, prefix: str) -> list[str]:
        def names() -> list[str]:
            return os.listdir(self._path(prefix) if prefix else self.root)

        try:
            found = await on_thread(None, names)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            if not prefix:  # a file where the root should be: not an empty store
                await self._root_is_no_file()
            return []
        return sorted(n for n in found if TEMP_MARKER not in n)

    async def _root_is_no_file(self) -> None:
        if await aiofiles.os.path.isfile(self.root):
            raise NotFoundError(f"{self.root} is a file, not a directory", backend=self.url)

    async def _stat(self, key: str) -> ObjectInfo:
        try:
            st = await on_thread(None, lambda: os.stat(self._path(key)))
        except OSError as exc:
            raise self._error(exc, key) from exc
        if not stat.S_ISREG(st.st_mode):
            raise NotFoundError("not an object (a directory)", backend=self.url, key=key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    async def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await finish_first(aiofiles.os.remove(path))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error(exc, key) from exc

    async def _delete_prefix(self, prefix: str) -> int:
        path = self._path(prefix)
        return await finish_first(aiofiles.os.wrap(_remove_tree)(path))

    async def sync_dirs(self, prefix: str) -> None:
        """fsync every directory below ``prefix`` and each ancestor up to the root (with
        ``fsync``). TensorStore fsyncs the files it writes; the directories it creates for
        them are made durable here."""
        if not self.fsync:
            return
        norm = validate_prefix(prefix)

        def sync() -> None:
            top = self._path(norm)  # resolving it takes a stat per level: off the loop too
            if not top.is_dir():
                raise NotFoundError(f"{top} is not a directory", backend=self.url, key=prefix)
            dirs = [Path(dirpath) for dirpath, _dirs, _files in os.walk(top)]
            dirs += [p for p in top.parents if p.is_relative_to(self.root)]
            # All at once: the caller needs every one durable, in no order among them.
            list(_DIR_SYNCERS.map(fsync_dir, dirs))  # the first error, if any, is raised here

        await aiofiles.os.wrap(sync)()

    async def prune_dirs(self, prefix: str) -> None:
        norm = validate_prefix(prefix).rstrip("/")
        if not norm:
            return
        top = self._path(norm)

        def prune() -> None:
            for below, _, _ in os.walk(top, topdown=False):  # links are not descended
                if below != str(top):
                    _remove_empty_dir(below)
            path = top
            while path != self.root and path.is_relative_to(self.root):
                if not _remove_empty_dir(str(path)):
                    return
                path = path.parent

        try:
            await aiofiles.os.wrap(prune)()
        except OSError as exc:
            raise self._error(exc, norm) from exc

    async def escapes(self, prefix: str) -> list[str]:
        top = self._path(validate_prefix(prefix))
        root = os.path.realpath(self.root)

        def walk() -> list[str]:
            out = []
            for dirpath, dirs, files in os.walk(top):  # links are listed, never followed
                for name in dirs + files:
                    path = os.path.join(dirpath, name)
                    real = os.path.realpath(path)
                    if real != root and not real.startswith(root + os.sep):
                        out.append(os.path.relpath(path, self.root).replace(os.sep, "/"))
            return sorted(out)

        return await aiofiles.os.wrap(walk)()

    async def remove_temporaries(
        self, older_than: float, *, dry_run: bool = False
    ) -> list[ObjectInfo]:
        """Temporary files of writes killed before their rename or link (`put_file`): a
        killed commit leaves one beside ``COMMITTED``, a killed part record one in a
        session that is resumed and committed later. Keys are relative to the root."""

        def sweep() -> list[ObjectInfo]:
            now, found = time.time(), []
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path) if TEMP_MARKER in name else None
                    except FileNotFoundError:  # its writer finished meanwhile
                        continue
                    if st is None or (older_than > 0 and now - st.st_mtime < older_than):
                        continue
                    if not dry_run:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                    key = os.path.relpath(path, self.root).replace(os.sep, "/")
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
            return sorted(found, key=lambda info: info.key)

        return await aiofiles.os.wrap(sweep)()


async def _walk(base: Path, prefix: str) -> list[ObjectInfo]:
    def walk() -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        if not base.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = os.path.relpath(dirpath, base)
            for name in files:
                if TEMP_MARKER in name:
                    continue
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # removed since the directory was read (a
                    continue  # concurrent writer's temporary file, say): not listed
                out.append(ObjectInfo(join(prefix, rel), st.st_size, st.st_mtime))
        out.sort(key=lambda info: info.key)
        return out

    return await aiofiles.os.wrap(walk)()


#: The most buffers one `os.preadv` call takes (Linux's IOV_MAX).
_IOV_MAX = 1024


def _pread_into(path: Path, offset: int, outs: Sequence[memoryview]) -> int:
    """Read into ``outs``, one after another, from ``offset`` until they are full or the
    file ends: one system call per `_IOV_MAX` buffers where the kernel fills them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pending = [o.cast("B") for o in outs if o.nbytes]
        done, first = 0, 0  # bytes read; the first buffer not yet full
        while first < len(pending):
            n = os.preadv(fd, pending[first : first + _IOV_MAX], offset + done)
            if n == 0:
                break
            done += n
            while first < len(pending) and n >= pending[first].nbytes:
                n -= pending[first].nbytes
                first += 1
            if n:  # a short read: the rest of that buffer next
                pending[first] = pending[first][n:]
        return done
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> int:
    """Remove files below ``path`` (then the empty directories); returns the file count.

    A symbolic link is removed as a link, never followed (a linked directory's content is
    not below ``path``). A directory a concurrent writer put something into meanwhile
    stays, with that new content: removal never fails because someone else was writing."""
    count = 0
    if path.is_symlink():
        os.remove(path)
        return 1
    if not path.is_dir():
        return 0
    for dirpath, dirs, files in os.walk(path, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            with contextlib.suppress(FileNotFoundError):  # a writer's temporary file, gone
                os.remove(os.path.join(dirpath, name))
                count += 0 if TEMP_MARKER in name else 1
        for name in dirs:
            _remove_dir(os.path.join(dirpath, name))
    _remove_dir(str(path))
    return count


def _remove_empty_dir(path: str) -> bool:
    """``rmdir`` if ``path`` is an empty directory (or gone already); False where it is not
    empty or not a directory (a link, a file), which stay as they are."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def _remove_dir(path: str) -> None:
    """``rmdir`` that leaves a directory gone already, a link (removed above) or one that
    is not empty (a concurrent writer's new file) alone."""
    try:
        os.rmdir(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise


def put_file(path: Path, parts: Sequence[Buffer], *, exclusive: bool, fsync: bool = True) -> None:
    """Write ``parts``, one after another, to ``path`` via a temporary sibling so the file
    appears whole or not at all.

    ``exclusive`` links instead of renaming, failing with EEXIST if ``path`` exists.
    """
    parent = path.parent
    tmp = parent / f".{path.name}{TEMP_MARKER}{uuid.uuid4().hex}"
    views = [memoryview(part).cast("B") for part in parts]
    new_dirs: list[Path] = []
    for tries in range(1, _PARENT_TRIES + 1):
        try:
            new_dirs += _makedirs(parent)
            _write_file(tmp, views, fsync=fsync)
            break
        except FileNotFoundError:
            # A directory on the way went between its mkdir and the next one, or the
            # write: a concurrent `prune_dirs` found it empty for that instant. Again,
            # after a pause that grows (a pruner spinning on it must not starve us).
            if tries == _PARENT_TRIES:
                raise
            time.sleep(min(0.001 * tries, 0.05))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    try:
        if exclusive:
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        for directory in [parent, *new_dirs]:
            fsync_dir(directory)


#: How often `put_file` makes its directory again when a concurrent `prune_dirs` removed it.
_PARENT_TRIES = 64


def _makedirs(parent: Path) -> list[Path]:
    """Create ``parent`` and missing ancestors; returns the parents of new directories."""
    created: list[Path] = []
    missing = []
    p = parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
            created.append(d.parent)
        except FileExistsError:
            pass
    return created


def fsync_dir(directory: Path) -> None:
    """Make ``directory``'s entries (a rename, a new link) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, views: Sequence[memoryview], *, fsync: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if fsync and sum(map(len, views)) >= _DIRECT_MIN and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # filesystems without O_DIRECT (tmpfs) say EINVAL
                raise
        else:
            try:
                _write_direct(fd, views)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
    fd = os.open(path, flags, 0o644)
    try:
        for view in views:
            _write_all(fd, view)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    offset = 0
    while offset < len(view):
        offset += os.write(fd, view[offset : offset + (64 << 20)])


def _write_direct(fd: int, views: Sequence[memoryview]) -> None:
    """Copy ``views`` one after another into an aligned staging buffer and write it out
    whenever it is full; the unaligned tail goes through the cache."""
    buf: mmap.mmap | None = getattr(_staging, "buf", None)
    if buf is None:
        buf = mmap.mmap(-1, _STAGE)
        _staging.buf = buf
    staged = memoryview(buf)
    fill = 0
    try:
        for view in views:
            taken = 0
            while taken < len(view):
                n = min(_STAGE - fill, len(view) - taken)
                staged[fill : fill + n] = view[taken : taken + n]
                fill += n
                taken += n
                if fill == _STAGE:
                    _write_all(fd, staged)
                    fill = 0
        aligned = fill - fill % _ALIGN
        _write_all(fd, staged[:aligned])
        if aligned < fill:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_all(fd, staged[aligned:fill])
    finally:
        staged.release()
