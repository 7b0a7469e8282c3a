"""What S3 and GCS share: large reads as parallel ranged GETs, and TensorStore's context.

One GET per object is one TCP stream: on a cloud it tops out far below what the
client's NIC can take. So `read_ranged` asks for the first ``part_size`` bytes
only; an object that fits is done in that one request, as before. For a larger
one the first reply's headers give the object's size and version (ETag,
generation), and the other parts start at once, each conditioned on that
version, while the first part's body is still arriving. The parts' bodies are
kept as the chunks the HTTP stack received and joined once, in order, into the
result: one copy per byte, no per-part buffers or concatenations (on these
machines a second copy of 256 MiB costs as much as the GETs themselves).

Consistency: every part must come from the same version with the same total
size and exactly the bytes asked for. A part that says otherwise, or a server
that answers the precondition with 412, raises `ObjectChangedError`: never a mix
of two versions. Transient failures of one part retry that part alone under the
backend's `RetryPolicy`; parts in flight across the backend are bounded by one
semaphore of ``read_concurrency`` slots (each read's first GET is the read's own
request and counts against the backend's ``concurrency`` like any other operation).

TensorStore's own requests (`ts_context`) retry under the same `RetryPolicy`
(its ``<driver>_request_retries`` resource) and give up on a stalled request too: see
`ObjectStoreBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from math import inf
from typing import Any, Protocol

import tensorstore as ts

from ckptstore.backends.base import Backend, is_empty_range
from ckptstore.backends.retry import RetryPolicy, retry_async
from ckptstore.backends.tsdeadline import bind
from ckptstore.backends.tserrors import retry_resource
from ckptstore.errors import (
    ConfigError,
    ObjectChangedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.runtime.futures import gather_first_error

MiB = 1 << 20
#: Parts smaller than this cost more in requests than they win in parallelism.
MIN_READ_PART = 1 * MiB
#: Seconds to wait for a connection, and for the next byte of a reply, before a request
#: counts as failed (transient: retried under the backend's `RetryPolicy`).
CONNECT_TIMEOUT = 30.0
READ_TIMEOUT = 60.0
#: TensorStore's HTTP stall timeout: a request moving (almost) no bytes for this many
#: seconds fails, transiently. Process-wide, read once, at TensorStore's first HTTP request.
TS_STALL_ENV = "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"
TS_STALL_SECONDS = 60

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass(frozen=True)
class ReadSplit:
    """How `read_ranged` splits a read: ``part_size`` bytes per GET, ``concurrency`` in flight.

    A read of at most ``part_size`` bytes is one GET; so ``part_size`` is also the
    threshold above which reads go parallel.
    """

    part_size: int
    concurrency: int

    def __post_init__(self) -> None:
        if isinstance(self.part_size, bool) or not isinstance(self.part_size, int):
            raise ConfigError(f"read_part_size must be an integer, got {self.part_size!r}")
        if self.part_size < MIN_READ_PART:
            raise ConfigError(f"read_part_size must be >= {MIN_READ_PART} (1 MiB)")
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise ConfigError(f"read_concurrency must be an integer >= 1: {self.concurrency!r}")


@dataclass
class RangeReply:
    """The headers of one ranged GET's reply, and its body still to read.

    ``start``/``length`` are the bytes the reply carries, ``total`` the object's
    size and ``version`` its ETag or generation. ``chunk`` returns the next piece
    of the body as received (b"" at its end) and raises only typed errors.
    """

    start: int
    length: int
    total: int
    version: str
    chunk: Callable[[], Awaitable[bytes]]


class ObjectStoreBackend(Backend):
    """The base of the S3 and GCS backends.

    ``_read`` is `read_ranged` over the subclass's `_open_range`. TensorStore's
    requests through `ts_context` are bounded by ``ts_request_concurrency`` (its
    ``<driver>_request_concurrency`` resource; None keeps TensorStore's default) and
    retried under the backend's ``retry`` policy (``<driver>_request_retries``).

    No request waits forever: ``connect_timeout`` bounds connecting and ``read_timeout``
    a wait for the next byte of a reply (the byte API's client timeouts). TensorStore
    has no per-context timeout; its stall timeout is the process-wide
    ``$TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``, which an object-store backend's context
    sets to `TS_STALL_SECONDS` unless the environment already has it (set it yourself,
    before TensorStore's first HTTP request, for another value).
    """

    #: TensorStore's context resources bounding and retrying this driver's requests.
    ts_concurrency_resource: str = ""
    ts_retries_resource: str = ""

    def __init__(
        self,
        *,
        read_part_size: int,
        read_concurrency: int,
        ts_request_concurrency: int | None,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        **options: Any,
    ):
        super().__init__(**options)
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < inf:
                raise ConfigError(
                    f"{name} must be a finite number of seconds > 0, got {value!r} "
                    f"(a {type(value).__name__})"
                )
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        self.read_split = ReadSplit(read_part_size, read_concurrency)
        self._read_parts: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        n = ts_request_concurrency
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"ts_request_concurrency must be an integer >= 1 or None: {n!r}")
        self.ts_request_concurrency = n

    def _new_ts_context(self) -> ts.Context:
        os.environ.setdefault(TS_STALL_ENV, str(TS_STALL_SECONDS))
        spec: dict[str, Any] = {self.ts_retries_resource: retry_resource(self.retry)}
        if self.ts_request_concurrency is not None:
            spec[self.ts_concurrency_resource] = {"limit": self.ts_request_concurrency}
        context = ts.Context(spec)
        bind(context, self.retry)  # the deadline bounds TensorStore's requests too
        return context

    @abstractmethod
    def _open_range(
        self, key: str, start: int, end: int, version: str | None
    ) -> contextlib.AbstractAsyncContextManager[RangeReply | None]:
        """A ranged GET of ``key``: see `RangeOpener`."""

    async def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        if is_empty_range(start, end):
            await self._stat(key)  # still NotFoundError for a missing key
            return b""
        loop = asyncio.get_running_loop()
        if self._read_parts is None or self._read_parts[0] is not loop:
            self._read_parts = loop, asyncio.Semaphore(self.read_split.concurrency)
        return await read_ranged(
            functools.partial(self._open_range, key),
            start or 0,
            end,
            self.read_split,
            self._read_parts[1],
            retry=self.retry,
            backend=self.url,
            key=key,
        )


class RangeOpener(Protocol):
    """A backend's ranged GET of bytes ``[start, end)``, conditioned on ``version`` if given.

    Yields None when the range starts at or past the end of the object (416).
    A failed ``version`` precondition raises `ObjectChangedError`.
    """

    def __call__(
        self, start: int, end: int, version: str | None
    ) -> contextlib.AbstractAsyncContextManager[RangeReply | None]: ...


def parse_content_range(value: str | None, length: int) -> tuple[int, int]:
    """``(start, total)`` of a ``Content-Range`` header (none: the whole object)."""
    if not value:
        return 0, length
    match = _CONTENT_RANGE.match(value.strip())
    if match is None or match.group(3) == "*":
        raise ValueError(f"unexpected Content-Range {value!r}")
    return int(match.group(1)), int(match.group(3))


async def collect(reply: RangeReply, limit: int) -> tuple[list[bytes], int]:
    """The reply's body as received, up to ``limit`` bytes, and its length (short if it was)."""
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = await reply.chunk()
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > limit:  # a server sending more than asked: keep what was asked
        chunks[-1] = chunks[-1][: len(chunks[-1]) - (got - limit)]
        got = limit
    return chunks, got


async def read_ranged(
    open_range: RangeOpener,
    start: int,
    end: int | None,
    split: ReadSplit,
    parts: asyncio.Semaphore,
    *,
    retry: RetryPolicy,
    backend: str,
    key: str,
) -> bytes:
    """Bytes ``[start, end)`` of an object (``end`` None: to its end), clamped to its size.

    The first GET is the read's own request (bounded, and retried, by the caller
    like any other operation); ``parts`` bounds the other part GETs in flight,
    across every read of the backend.
    """
    first_end = start + split.part_size if end is None else min(end, start + split.part_size)
    stack = contextlib.AsyncExitStack()
    async with stack:
        reply = await stack.enter_async_context(open_range(start, first_end, None))
        if reply is None:
            return b""  # the range starts at or past the end
        stop = reply.total if end is None else min(end, reply.total)
        if reply.start != start or reply.length != min(stop, first_end) - start:
            raise StorageError(
                f"read failed: asked for bytes from {start}, the server sent "
                f"{reply.start}-{reply.start + reply.length}/{reply.total}",
                backend=backend,
                key=key,
            )
        if stop <= first_end:  # it fits in one GET
            chunks, got = await collect(reply, stop - start)
            if got != stop - start:
                raise TransientStorageError(
                    f"read failed: the body ended after {got} of {stop - start} bytes",
                    backend=backend,
                    key=key,
                )
            return b"".join(chunks)
        version, total = reply.version, reply.total
        bounds = [*range(start, stop, split.part_size), stop]
        pieces: list[list[bytes]] = [[] for _ in bounds[1:]]

        async def fetch(index: int) -> None:
            """Part ``index``, conditioned on the first reply's version, retried alone."""
            lo, hi = bounds[index], bounds[index + 1]

            async def attempt(_: int) -> None:
                async with parts, open_range(lo, hi, version) as part:
                    _check_part(part, lo, hi, version, total, backend=backend, key=key)
                    assert part is not None
                    chunks, got = await collect(part, hi - lo)
                if got != hi - lo:
                    raise TransientStorageError(
                        f"read failed: part {lo}-{hi} ended after {got} bytes",
                        backend=backend,
                        key=key,
                    )
                pieces[index] = chunks

            await retry_async(attempt, retry)

        async def first_part() -> None:
            """The first reply's body; fetched again (conditioned) if it breaks off."""
            try:
                chunks, got = await collect(reply, bounds[1] - start)
            except TransientStorageError:
                chunks, got = [], -1
            finally:
                await stack.aclose()  # the connection goes back to the pool now
            if got == bounds[1] - start:
                pieces[0] = chunks
            else:
                await fetch(0)

        await gather_first_error([first_part(), *(fetch(i) for i in range(1, len(pieces)))])
        return b"".join(chunk for piece in pieces for chunk in piece)
    raise AssertionError("unreachable")  # pragma: no cover - the stack never swallows


def replaced(*, backend: str, key: str) -> ObjectChangedError:
    """The error for a part whose version precondition the server refused (412)."""
    return ObjectChangedError(
        "read failed: the object was replaced while it was read in parts", backend=backend, key=key
    )


def _check_part(
    part: RangeReply | None,
    lo: int,
    hi: int,
    version: str,
    total: int,
    *,
    backend: str,
    key: str,
) -> None:
    """Refuse a part from another version, of another size or with other bytes than asked."""
    if part is None or part.version != version or part.total != total:
        raise ObjectChangedError(
            "read failed: the object changed while it was read in parts "
            f"(size {total} -> {'gone' if part is None else part.total}"
            f"{'' if part is None or part.version == version else ', new version'})",
            backend=backend,
            key=key,
        )
    if part.start != lo or part.length != hi - lo:  # same version: the server's mistake
        raise StorageError(
            f"read failed: asked for bytes {lo}-{hi}, the server sent "
            f"{part.start}-{part.start + part.length}",
            backend=backend,
            key=key,
        )
