"""The `Backend` protocol: async byte operations on keys, plus the TensorStore view.

Every storage consumer in ckptstore (per-process writers, the merge, partial
saves, promotion) talks to this class only. Subclasses implement the
underscore methods; the public methods here validate keys before any I/O,
bound concurrency and retry transient failures, so those rules are the same on
every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import tensorstore as ts

from ckptstore.backends.keys import validate_key, validate_prefix
from ckptstore.backends.retry import NO_RETRY, RetryPolicy, retry_async
from ckptstore.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    RetriesExhaustedError,
    ShortReadError,
)

T = TypeVar("T")
#: What a write takes: any contiguous buffer of bytes.
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key (relative to the backend root) and size in bytes."""

    key: str
    size: int
    mtime: float | None = None  # seconds since the epoch, when the backend knows it


# Aliases: inside `Backend`, the name ``list`` is the method.
Infos = list[ObjectInfo]
Names = list[str]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do natively, so callers pick a protocol instead of guessing.

    - ``atomic_rename``: a rename is atomic and O(1) (POSIX), not a copy.
    - ``conditional_create``: the server itself enforces create-if-absent; when
      False, `Backend.create` checks first and two racing creators may both win.
    - ``server_side_copy``: objects can be copied without passing through the client.
    - ``durable_writes``: a finished `write` survives a crash of this machine.
    - ``direct_reads``: `read_into` costs one copy from the operating system (local
      files), so restores read chunk data themselves rather than through TensorStore.
    """

    atomic_rename: bool
    conditional_create: bool
    server_side_copy: bool
    durable_writes: bool
    direct_reads: bool = False


class Backend(ABC):
    """An async key/value byte store rooted at one location.

    Keys are ``/``-separated and relative to the root (see `ckptstore.backends.keys`).
    A backend is used from one event loop at a time.
    """

    #: Short backend type name ("local", "memory", "s3", "gcs", ...).
    kind: str = "abstract"
    capabilities: Capabilities

    def __init__(self, *, retry: RetryPolicy = NO_RETRY, concurrency: int = 32):
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.retry = retry
        self.concurrency = concurrency
        self._semaphore: asyncio.Semaphore | None = None
        self._semaphore_loop: asyncio.AbstractEventLoop | None = None

    # ---- identity ----

    @property
    @abstractmethod
    def url(self) -> str:
        """A URL naming the root; never contains a credential."""

    @property
    def location(self) -> str:
        """What storage this is, as one string: two backends with equal locations (or one
        nested in the other, by a ``/``-separated prefix) are the same bytes, however their
        URLs were spelled. Local disk: the real path; object stores: endpoint and URL."""
        return self.url.rstrip("/")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    # ---- the operations ----

    async def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read the object, or bytes ``[start, end)`` of it (clamped to its size)."""
        validate_key(key)
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError(f"byte range must be non-negative, got [{start}, {end})")
        nbytes = end - start if start is not None and end is not None else 0
        return await self._run(lambda _: self._read(key, start, end), key, nbytes)

    async def read_into(
        self, key: str, offset: int, out: memoryview | Sequence[memoryview]
    ) -> None:
        """Fill ``out`` (a byte buffer, or several filled one after another) with the
        object's bytes from ``offset`` on; an object too short to fill it is a
        `ShortReadError`."""
        validate_key(key)
        if offset < 0:
            raise ValueError(f"offset must be non-negative, got {offset}")
        outs = [out] if isinstance(out, memoryview) else list(out)
        want = sum(o.nbytes for o in outs)
        got = await self._run(lambda _: self._read_into(key, offset, outs), key, want)
        if got != want:
            raise ShortReadError(
                f"{key}: {got} bytes at offset {offset}, {want} expected", backend=self.url, key=key
            )

    async def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole object; readers see either the old or the new bytes, never a mix."""
        validate_key(key)
        await self._run(lambda _: self._write(key, data), key, memoryview(data).nbytes)

    async def write_gather(self, key: str, parts: Sequence[Buffer]) -> None:
        """Write ``parts``, one after another, as one object (like `write`): many small
        buffers become one object without a joined copy where the backend can avoid it."""
        validate_key(key)
        await self._run(
            lambda _: self._write_gather(key, parts), key, sum(memoryview(p).nbytes for p in parts)
        )

    async def create(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``key`` only if it does not exist yet: the commit primitive.

        Raises `AlreadyExistsError` if it exists. If an earlier try failed
        transiently but in fact landed (its reply was lost), the key holds exactly
        ``data``: that counts as success; give commit markers unique content. Such a
        try may be the HTTP client's own: aiohttp resends an idempotent request (a PUT)
        once when a connection drops, within one of our attempts.
        """
        validate_key(key)

        async def attempt(_: int) -> None:
            try:
                await self._create(key, data)
            except AlreadyExistsError:
                with contextlib.suppress(NotFoundError):  # gone again: still not ours
                    if await self._read(key, None, None) == bytes(data):
                        return
                raise

        await self._run(attempt, key, memoryview(data).nbytes)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object below ``prefix`` (a directory-like prefix), sorted by key."""
        norm = validate_prefix(prefix)
        for info in await self._run(lambda _: self._list(norm), norm, None):
            yield info

    async def list_dir(self, prefix: str = "") -> Names:
        """Names of the immediate children of ``prefix`` (objects and sub-prefixes), sorted."""
        norm = validate_prefix(prefix)
        return await self._run(lambda _: self._list_dir(norm))

    async def stat(self, key: str) -> ObjectInfo:
        """Size (and mtime where known) of one object; `NotFoundError` if absent."""
        validate_key(key)
        return await self._run(lambda _: self._stat(key), key)

    async def exists(self, key: str) -> bool:
        """Whether the object exists."""
        validate_key(key)
        return await self._run(lambda _: self._exists(key), key)

    async def delete(self, key: str) -> None:
        """Delete one object; deleting a missing key is not an error."""
        validate_key(key)
        await self._run(lambda _: self._delete(key), key)

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every object below ``prefix``; returns how many were deleted.

        An empty prefix (the whole root) is refused: pass the root explicitly by
        deleting the backend's location with its own tools.
        """
        norm = validate_prefix(prefix)
        if norm == "":
            raise ValueError("delete_prefix('') would delete the whole root; refused")
        return await self._run(lambda _: self._delete_prefix(norm), norm, None)

    async def check_root(self) -> None:
        """Raise `NotFoundError` if the root itself (a directory, a bucket) does not exist.

        An empty root is not an error. Object stores have no directories: an empty prefix
        in an existing bucket exists, a missing bucket does not. Lets tools tell a mistyped
        target from one that holds nothing yet (writes create a missing local root).
        """
        await self._run(lambda _: self._check_root())

    async def _check_root(self) -> None:
        return None  # memory: a store exists once named

    @abstractmethod
    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        """The TensorStore kvstore spec reaching the same bytes as ``prefix`` here.

        Open it with `ts_context` so that backends whose state lives in the
        context (memory, shared HTTP pools) see the same data.
        """

    @property
    def ts_context(self) -> ts.Context:
        """The `tensorstore.Context` to open `kvstore_spec` specs with (made once)."""
        ctx: ts.Context | None = getattr(self, "_ts_context", None)
        if ctx is None:
            ctx = self._ts_context = self._new_ts_context()
        return ctx

    def _new_ts_context(self) -> ts.Context:
        """The context `ts_context` creates; backends with their own resources override it."""
        return ts.Context()

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and other resources."""

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ---- what subclasses implement ----

    @abstractmethod
    async def _read(self, key: str, start: int | None, end: int | None) -> bytes: ...

    async def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> int:
        """Bytes read into ``outs``, one after another (fewer at the object's end);
        backends with a cheaper way than `_read` and a copy override it."""
        data = memoryview(await self._read(key, offset, offset + sum(o.nbytes for o in outs)))
        done = 0
        for o in outs:
            piece = data[done : done + o.nbytes]
            o.cast("B")[: len(piece)] = piece
            done += len(piece)
        return done

    @abstractmethod
    async def _write(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    async def _write_gather(self, key: str, parts: Sequence[Buffer]) -> None:
        """Local disks stream the parts (`LocalBackend`); others join them once."""
        joined = await asyncio.to_thread(b"".join, parts) if len(parts) != 1 else parts[0]
        await self._write(key, joined)

    @abstractmethod
    async def _create(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    async def _list(self, prefix: str) -> Infos: ...

    @abstractmethod
    async def _list_dir(self, prefix: str) -> Names: ...

    @abstractmethod
    async def _stat(self, key: str) -> ObjectInfo: ...

    async def _exists(self, key: str) -> bool:
        """`exists` without validation, bounds or retries: for use inside other operations."""
        try:
            await self._stat(key)
        except NotFoundError:
            return False
        return True

    @abstractmethod
    async def _delete(self, key: str) -> None: ...

    @abstractmethod
    async def _delete_prefix(self, prefix: str) -> int: ...

    # ---- shared machinery ----

    def _sem(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore_loop is not loop:
            self._semaphore = asyncio.Semaphore(self.concurrency)
            self._semaphore_loop = loop
        return self._semaphore

    async def _run(
        self,
        op: Callable[[int], Awaitable[T]],
        key: str | None = None,
        nbytes: int | None = 0,
    ) -> T:
        """Run ``op(attempt)`` under the concurrency bound, retrying transient failures,
        within the retry policy's deadline for ``nbytes`` (counted from the first slot;
        ``nbytes=None``: an operation whose work grows with the objects it meets, a
        recursive listing or deletion, has none)."""
        limit = None if nbytes is None else self.retry.limit(nbytes)
        loop = asyncio.get_running_loop()
        started: float | None = None

        async def bounded(attempt: int) -> T:
            nonlocal started
            async with self._sem():
                if limit is None:
                    return await op(attempt)
                if started is None:
                    started = loop.time()
                left = limit - (loop.time() - started)
                timer = asyncio.timeout(max(left, 0.0))
                try:
                    async with timer:
                        return await op(attempt)
                except TimeoutError as exc:
                    if not timer.expired():
                        raise  # the operation's own timeout, not the deadline
                    raise RetriesExhaustedError(
                        f"no result within the {limit:.0f} s deadline (retry policy)",
                        backend=self.url,
                        key=key,
                    ) from exc

        return await retry_async(bounded, self.retry)


def slice_range(data: bytes, start: int | None, end: int | None) -> bytes:
    """Apply a read's ``[start, end)`` to whole-object bytes (for backends that read whole)."""
    if start is None and end is None:
        return data
    return data[start or 0 : end]


def is_empty_range(start: int | None, end: int | None) -> bool:
    """Whether ``[start, end)`` selects no bytes whatever the object's size."""
    return end is not None and end <= (start or 0)


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of any buffer (numpy arrays, typed memoryviews, ...)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
