"""The fault-injecting proxy itself: transparent when idle, each fault kind as documented.

Upstreams are the real emulators (moto's S3 server, fake-gcs-server); clients are raw
HTTP (urllib) and the backends' own clients.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.retry import NO_RETRY
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import TransientStorageError
from ckptstore.testing.faultproxy import Fault, FaultProxy, Seen, serial_chain
from ckptstore.testing.servers import FakeGcsServer, MotoS3Server


@pytest.fixture
def proxy(ckptstore_s3_server: MotoS3Server) -> Iterator[FaultProxy]:
    with FaultProxy(ckptstore_s3_server.endpoint) as p:
        yield p


def get(url: str, *, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
    """One raw request: its status and body (HTTP errors included)."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def s3(proxy: FaultProxy, bucket: str) -> S3Backend:
    return S3Backend(bucket, "p", endpoint_url=proxy.endpoint, credentials="env", retry=NO_RETRY)


async def test_idle_proxy_is_transparent(proxy: FaultProxy, ckptstore_s3_bucket: str) -> None:
    """Writes, whole and ranged reads, stat (a HEAD: its length header), listing, delete."""
    data = bytes(range(256)) * 40
    async with s3(proxy, ckptstore_s3_bucket) as b:
        await b.write("a/x", data)
        assert await b.read("a/x") == data
        assert await b.read("a/x", 100, 300) == data[100:300]
        assert (await b.stat("a/x")).size == len(data)
        assert [i.key async for i in b.list("a")] == ["a/x"]
        await b.delete("a/x")
        assert not await b.exists("a/x")
    assert proxy.injected == {}
    assert {s.method for s in proxy.seen} >= {"PUT", "GET", "HEAD", "DELETE"}


async def test_status_on_the_nth_request(proxy: FaultProxy, ckptstore_s3_bucket: str) -> None:
    async with s3(proxy, ckptstore_s3_bucket) as b:
        await b.write("k", b"v")
        proxy.set_faults(Fault("status", nth=frozenset({2}), methods=frozenset({"GET"})))
        assert await b.read("k") == b"v"  # GET 1
        with pytest.raises(TransientStorageError, match="503"):
            await b.read("k")  # GET 2
        assert await b.read("k") == b"v"  # GET 3
        assert (await b.stat("k")).size == 1  # a HEAD never matches
    assert proxy.injected == {"status": 1}
    assert [s.fault for s in proxy.seen if s.fault] == ["status 503"]


def test_rate_is_seeded(ckptstore_s3_server: MotoS3Server) -> None:
    """The same seed hits the same requests; another seed, others; about `rate` of them."""

    def pattern(seed: int) -> list[int]:
        rules = [Fault("status", rate=0.3), Fault("status", status=404, rate=1.0)]  # no upstream
        with FaultProxy(ckptstore_s3_server.endpoint, rules, seed=seed) as p:
            return [get(p.endpoint + "/")[0] for _ in range(60)]

    first, again, other = pattern(7), pattern(7), pattern(8)
    assert first == again
    assert first != other
    assert set(first) == {404, 503}
    assert 6 <= first.count(503) <= 30


def test_filters_and_limit(proxy: FaultProxy, ckptstore_s3_bucket: str) -> None:
    proxy.set_faults(
        Fault(
            "status",
            status=500,
            rate=1.0,
            path=f"^/{ckptstore_s3_bucket}",
            methods=frozenset({"GET"}),
        )
    )
    assert get(proxy.endpoint + "/")[0] == 200  # another path
    assert (
        get(proxy.endpoint + f"/{ckptstore_s3_bucket}", method="HEAD")[0] == 200
    )  # another method
    status, body = get(proxy.endpoint + f"/{ckptstore_s3_bucket}")
    assert status == 500 and b"<Code>InternalError</Code>" in body
    proxy.set_faults(Fault("status", status=429, rate=1.0, agent="^Python-urllib", limit=2))
    assert [get(proxy.endpoint + "/")[0] for _ in range(3)] == [429, 429, 200]


async def test_drop_truncate_and_lost_reply(proxy: FaultProxy, ckptstore_s3_bucket: str) -> None:
    """(aiohttp itself sends an idempotent request again once when a connection drops:
    every such request is hit here.)"""
    async with s3(proxy, ckptstore_s3_bucket) as b:
        proxy.set_faults(Fault("drop", rate=1.0))
        with pytest.raises(TransientStorageError):
            await b.write("dropped", b"v")
        proxy.set_faults()
        assert not await b.exists("dropped")  # it never reached the server

        proxy.set_faults(Fault("lost_reply", rate=1.0))
        with pytest.raises(TransientStorageError):
            await b.write("lost", b"v")
        proxy.set_faults()
        assert await b.read("lost") == b"v"  # it took effect; only its reply was lost

        await b.write("whole", b"x" * 1000)
        proxy.set_faults(Fault("truncate", nth=frozenset({1})))
        with pytest.raises(TransientStorageError, match="500 of 1000"):
            await b.read("whole")
    assert proxy.injected["truncate"] == 1
    assert proxy.injected["drop"] >= 1 and proxy.injected["lost_reply"] >= 1


def test_latency_and_blackhole(ckptstore_s3_server: MotoS3Server) -> None:
    with FaultProxy(ckptstore_s3_server.endpoint, [Fault("latency", rate=1.0, delay=0.3)]) as p:
        start = time.monotonic()
        assert get(p.endpoint + "/")[0] == 200
        assert time.monotonic() - start >= 0.3
        p.set_faults(Fault("blackhole", rate=1.0))
        start = time.monotonic()
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            get(p.endpoint + "/", timeout=0.5)
        assert 0.5 <= time.monotonic() - start < 5
        assert p.injected == {"latency": 1, "blackhole": 1}
    # stopping cut the black-holed request; a stopped proxy has no endpoint
    with pytest.raises(RuntimeError):
        p.endpoint  # noqa: B018


async def test_rate_limit_caps_all_connections_both_ways(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    """Four concurrent uploads to moto, then four concurrent reads, through a proxy capped
    at 20 MB/s: each batch takes at least its bytes over the cap (one bucket shared by the
    connections; a lower bound on time only, which load cannot break)."""
    cap, part = 20e6, 2 * 1024 * 1024
    data = [bytes([i]) * part for i in range(4)]
    total = sum(len(d) for d in data)
    with FaultProxy(ckptstore_s3_server.endpoint, rate_limit_bytes_per_s=cap) as p:
        async with s3(p, ckptstore_s3_bucket) as b:
            start = time.monotonic()
            await asyncio.gather(*(b.write(f"rl/{i}", d) for i, d in enumerate(data)))
            wrote = time.monotonic() - start
            assert p.limited_bytes >= total
            start = time.monotonic()
            got = await asyncio.gather(*(b.read(f"rl/{i}") for i in range(len(data))))
            read = time.monotonic() - start
        assert got == data
        assert p.limited_bytes >= 2 * total
    assert wrote >= 0.9 * total / cap, wrote
    assert read >= 0.9 * total / cap, read
    with pytest.raises(ValueError, match="positive"):
        FaultProxy(ckptstore_s3_server.endpoint, rate_limit_bytes_per_s=0)


async def test_gcs_resumable_upload_stays_behind_the_proxy(
    ckptstore_gcs_server: FakeGcsServer, ckptstore_gcs_bucket: str
) -> None:
    """fake-gcs-server's session URL names itself; the proxy rewrites it to its own."""
    data = bytes(range(256)) * 2048  # 512 KiB: two 256 KiB chunks
    with FaultProxy(ckptstore_gcs_server.endpoint) as p:
        b = GcsBackend(
            ckptstore_gcs_bucket,
            "p",
            endpoint_url=p.endpoint,
            credentials="anonymous",
            emulator=True,
            retry=NO_RETRY,
            resumable_threshold=1,
            chunk_size=256 * 1024,
        )
        async with b:
            await b.write("big", data)
            assert await b.read("big") == data
        puts = [s for s in p.seen if s.method == "PUT"]
    assert len(puts) == 2 and all(s.path.startswith("/upload/") for s in puts)


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate"):
        Fault("status", rate=1.5)


def test_serial_chain_counts_only_requests_that_waited_for_another() -> None:
    def req(at: float, done: float | None, path: str) -> Seen:
        return Seen(at, "GET", path, "t", None, done)

    seen = [
        req(0.0, 1.0, "a"),
        req(0.1, 1.1, "b"),  # issued with a: not after it
        req(1.2, 2.0, "c"),  # after both
        req(0.9, 1.9, "d"),  # issued while a and b ran
        req(2.0, 3.0, "e"),  # after c (ends at 2.0) and d
        req(2.5, None, "f"),  # cut off: never answered, not counted
    ]
    assert [s.path for s in serial_chain(seen)] == ["a", "c", "e"]
    assert serial_chain([]) == []
