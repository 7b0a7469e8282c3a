"""Large reads as parallel ranged GETs, on moto's S3 server and fake-gcs-server over HTTP.

The backends run with 1 MiB parts so that a few MiB exercise every path. Counting and
fault injection wrap the backend's own ranged-GET function (`_open_range`): the bytes
always come from the emulator over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from botocore.exceptions import ClientError

from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.objectstore import ObjectStoreBackend, RangeReply
from ckptstore.backends.registry import open_backend
from ckptstore.backends.retry import NO_RETRY, RetryPolicy
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import (
    ConfigError,
    NotFoundError,
    ObjectChangedError,
    RetriesExhaustedError,
    TransientStorageError,
)
from ckptstore.testing.servers import FakeGcsServer, MotoS3Server

MiB = 1 << 20
PART = 1 * MiB
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01)


def make(kind: str, request: pytest.FixtureRequest, **kw: Any) -> ObjectStoreBackend:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("read_part_size", PART)
    kw.setdefault("read_concurrency", 3)
    if kind == "s3":
        server: MotoS3Server = request.getfixturevalue("ckptstore_s3_server")
        bucket = request.getfixturevalue("ckptstore_s3_bucket")
        return S3Backend(bucket, "r", endpoint_url=server.endpoint, credentials="env", **kw)
    gcs: FakeGcsServer = request.getfixturevalue("ckptstore_gcs_server")
    bucket = request.getfixturevalue("ckptstore_gcs_bucket")
    return GcsBackend(
        bucket, "r", endpoint_url=gcs.endpoint, credentials="anonymous", emulator=True, **kw
    )


@pytest.fixture(params=["s3", "gcs"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[ObjectStoreBackend]:
    async with make(request.param, request) as b:
        yield b


Opener = Callable[..., contextlib.AbstractAsyncContextManager[RangeReply | None]]


class Recorder:
    """Wraps a backend's `_open_range`: records every GET and the most in flight at once.

    ``before(start, end, version)`` runs before a GET is sent (to replace the object,
    or to raise); ``cut`` names part starts whose body breaks off after one chunk, once.
    """

    def __init__(self, backend: ObjectStoreBackend) -> None:
        self.inner: Opener = backend._open_range
        self.calls: list[tuple[int, int, str | None]] = []
        self.in_flight = self.most = self.most_conditioned = self.conditioned = 0
        self.before: Callable[[int, int, str | None], Any] | None = None
        self.cut: set[int] = set()
        backend._open_range = self.open  # type: ignore[method-assign]

    @contextlib.asynccontextmanager
    async def open(
        self, key: str, start: int, end: int, version: str | None
    ) -> AsyncIterator[RangeReply | None]:
        self.calls.append((start, end, version))
        if self.before is not None:
            await self.before(start, end, version)
        self.in_flight += 1
        self.conditioned += version is not None
        self.most = max(self.most, self.in_flight)
        self.most_conditioned = max(self.most_conditioned, self.conditioned)
        try:
            async with self.inner(key, start, end, version) as reply:
                if reply is not None and start in self.cut:
                    self.cut.discard(start)
                    reply.chunk = self._breaking(reply.chunk)
                yield reply
        finally:
            self.in_flight -= 1
            self.conditioned -= version is not None

    @staticmethod
    def _breaking(chunk: Callable[[], Any]) -> Callable[[], Any]:
        sent = False

        async def once() -> bytes:
            nonlocal sent
            if sent:
                raise TransientStorageError("injected: connection reset mid-body")
            sent = True
            data: bytes = await chunk()
            return data

        return once


# ---- bit-exact ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size", [0, 1, PART - 1, PART, PART + 1, 3 * PART, 5 * PART + 7], ids=lambda n: f"{n}B"
)
async def test_whole_reads_are_exact(backend: ObjectStoreBackend, size: int) -> None:
    data = os.urandom(size)
    await backend.write("obj", data)
    rec = Recorder(backend)
    got = await backend.read("obj")
    assert type(got) is bytes and got == data
    parts = max(1, -(-size // PART))
    assert len(rec.calls) == parts  # one GET per part, the first unconditioned
    assert [c[2] is None for c in rec.calls] == [True] + [False] * (parts - 1)
    assert sorted((s, min(e, size)) for s, e, _ in rec.calls) == [
        (i * PART, min((i + 1) * PART, size)) for i in range(parts)
    ]


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (0, 2 * PART + 1),
        (PART - 1, PART + 1),
        (7, None),
        (PART + 3, 4 * PART + 11),
        (3 * PART, 10 * PART),  # clamped to the object
        (4 * PART + 1, None),
        (4 * PART + 2, 4 * PART + 9),  # past the end: empty
        (9 * PART, None),
    ],
)
async def test_ranged_reads_are_exact(
    backend: ObjectStoreBackend, start: int, end: int | None
) -> None:
    data = os.urandom(4 * PART + 2)
    await backend.write("obj", data)
    assert await backend.read("obj", start, end) == data[start:end]


async def test_missing_key_is_not_found(backend: ObjectStoreBackend) -> None:
    with pytest.raises(NotFoundError):
        await backend.read("absent")
    with pytest.raises(NotFoundError):
        await backend.read("absent", 5, 9)


# ---- bounded concurrency -----------------------------------------------------------------------


async def test_parts_in_flight_stay_within_read_concurrency(backend: ObjectStoreBackend) -> None:
    """Two 8-part reads at once: at most 3 conditioned parts in flight across the backend."""
    a, b = os.urandom(8 * PART), os.urandom(8 * PART - 5)
    await backend.write("a", a)
    await backend.write("b", b)
    rec = Recorder(backend)
    assert await asyncio.gather(backend.read("a"), backend.read("b")) == [a, b]
    assert rec.most_conditioned == 3  # the bound is reached and never passed
    assert rec.most <= 3 + 2  # plus each read's own first GET
    assert len(rec.calls) == 16


async def test_read_concurrency_one_still_completes(request: pytest.FixtureRequest) -> None:
    async with make("s3", request, read_concurrency=1) as b:
        data = os.urandom(4 * PART + 1)
        await b.write("obj", data)
        rec = Recorder(b)
        assert await b.read("obj") == data
        assert rec.most_conditioned == 1


# ---- the object changes between parts ----------------------------------------------------------


@pytest.mark.parametrize("new_size", [4 * PART, 2 * PART + 3], ids=["replaced", "truncated"])
async def test_object_replaced_between_parts_is_typed_error(
    backend: ObjectStoreBackend, new_size: int
) -> None:
    await backend.write("obj", os.urandom(4 * PART))
    rec = Recorder(backend)
    replaced = False

    async def replace(start: int, end: int, version: str | None) -> None:
        nonlocal replaced
        if version is not None and not replaced:
            replaced = True
            await backend.write("obj", os.urandom(new_size))

    rec.before = replace
    with pytest.raises(ObjectChangedError) as info:
        await backend.read("obj")
    assert info.value.key == "obj"
    if isinstance(backend, S3Backend):
        # moto honours If-Match: the server refused the part (412), not the client check.
        cause = info.value.__cause__
        assert cause is not None and isinstance(cause.__cause__, ClientError)
    # fake-gcs-server ignores ifGenerationMatch on reads; the reply's x-goog-generation
    # differs from the first part's, and that check raises instead.
    rec.before = None
    assert len(await backend.read("obj")) == new_size  # a fresh read sees the new object


async def test_object_deleted_between_parts_is_typed_error(backend: ObjectStoreBackend) -> None:
    await backend.write("obj", os.urandom(3 * PART))
    rec = Recorder(backend)

    async def delete(start: int, end: int, version: str | None) -> None:
        if version is not None:
            await backend.delete("obj")

    rec.before = delete
    with pytest.raises((NotFoundError, ObjectChangedError)):
        await backend.read("obj")


# ---- transient failures of one part ------------------------------------------------------------


async def test_transient_failure_retries_that_part_only(backend: ObjectStoreBackend) -> None:
    data = os.urandom(5 * PART + 7)
    await backend.write("obj", data)
    rec = Recorder(backend)
    failed: list[int] = []

    async def fail_part_3(start: int, end: int, version: str | None) -> None:
        if start == 3 * PART and not failed:
            failed.append(start)
            raise TransientStorageError("injected: 503 on one part", key="obj")

    rec.before = fail_part_3
    assert await backend.read("obj") == data
    starts = [s for s, _, _ in rec.calls]
    assert starts.count(3 * PART) == 2 and len(starts) == 7  # 6 parts, one of them twice


@pytest.mark.parametrize("where", [0, 2 * PART], ids=["first-part", "later-part"])
async def test_body_cut_mid_part_is_fetched_again(backend: ObjectStoreBackend, where: int) -> None:
    data = os.urandom(4 * PART - 3)
    await backend.write("obj", data)
    rec = Recorder(backend)
    rec.cut = {where}
    assert await backend.read("obj") == data
    again = [v for s, _, v in rec.calls if s == where]
    assert len(again) == 2 and again[1] is not None  # the retry is conditioned on the version


async def test_persistent_part_failure_exhausts_retries(backend: ObjectStoreBackend) -> None:
    await backend.write("obj", os.urandom(3 * PART))
    rec = Recorder(backend)

    async def always(start: int, end: int, version: str | None) -> None:
        if start == PART:
            raise TransientStorageError("injected: throttled", key="obj")

    rec.before = always
    with pytest.raises(RetriesExhaustedError):
        await backend.read("obj")
    assert [s for s, _, _ in rec.calls].count(PART) == FAST_RETRY.max_attempts


async def test_without_retries_a_part_failure_is_transient(request: pytest.FixtureRequest) -> None:
    async with make("gcs", request, retry=NO_RETRY) as b:
        await b.write("obj", os.urandom(2 * PART + 1))
        rec = Recorder(b)

        async def fail(start: int, end: int, version: str | None) -> None:
            if version is not None:
                raise TransientStorageError("injected", key="obj")

        rec.before = fail
        with pytest.raises(TransientStorageError) as info:
            await b.read("obj")
        assert not isinstance(info.value, RetriesExhaustedError)


# ---- options -----------------------------------------------------------------------------------


def test_invalid_read_options() -> None:
    with pytest.raises(ConfigError, match="read_part_size"):
        S3Backend("bucket", read_part_size=1000)
    with pytest.raises(ConfigError, match="read_concurrency"):
        GcsBackend("bucket", credentials="anonymous", read_concurrency=0)
    with pytest.raises(ConfigError, match="read_concurrency"):
        S3Backend("bucket", read_concurrency=True)


def test_read_options_from_url_and_defaults() -> None:
    b = open_backend("s3://bucket/p", read_part_size=8 * MiB, read_concurrency=4)
    assert isinstance(b, S3Backend)
    assert (b.read_split.part_size, b.read_split.concurrency) == (8 * MiB, 4)
    g = open_backend("gs://bucket/p", credentials="anonymous")
    assert isinstance(g, GcsBackend) and g.read_split.part_size >= 8 * MiB


def test_ts_request_concurrency_reaches_the_context() -> None:
    s3 = S3Backend("bucket", ts_request_concurrency=4)
    assert s3.ts_context["s3_request_concurrency"].to_json() == {"limit": 4}
    gcs = GcsBackend("bucket", credentials="anonymous", ts_request_concurrency=2)
    assert gcs.ts_context["gcs_request_concurrency"].to_json() == {"limit": 2}
    assert S3Backend("bucket").ts_context["s3_request_concurrency"].to_json() == {}
    with pytest.raises(ConfigError, match="ts_request_concurrency"):
        S3Backend("bucket", ts_request_concurrency=0)
