"""No operation on the data path hangs: against a closed port, or a server that accepts and
never answers (`FaultProxy`'s black hole), save, restore and verify end in a typed error
within a bounded time, whether the byte API (s3fs/gcsfs timeouts) or TensorStore's requests
(its stall timeout) meet the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.keys import join
from ckptstore.backends.objectstore import TS_STALL_ENV
from ckptstore.backends.retry import RetryPolicy
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import ConfigError, TransientStorageError
from ckptstore.testing.faultproxy import Fault, FaultProxy

REPO = Path(__file__).resolve().parents[2]
POLICY = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.05)
FAST = {"connect_timeout": 0.25, "read_timeout": 0.25}
#: Seconds an operation may take against a dead endpoint with these settings (generous:
#: the machine running the tests may be busy).
BOUND = 15.0
TREE = {"x": np.arange(655_360.0), "n": 3}  # x (5 MiB) through TensorStore, n packed


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def make(kind: str, bucket: str, endpoint: str, retry: RetryPolicy = POLICY, **kw: Any) -> Backend:
    if kind == "s3":
        return S3Backend(bucket, "run", endpoint_url=endpoint, credentials="env", retry=retry, **kw)
    return GcsBackend(
        bucket,
        "run",
        endpoint_url=endpoint,
        credentials="anonymous",
        retry=retry,
        emulator=True,
        **kw,
    )


@pytest.fixture(params=["s3", "gcs"])
def store(request: pytest.FixtureRequest) -> tuple[str, str, str]:
    """(kind, bucket, emulator endpoint)."""
    kind = request.param
    server = request.getfixturevalue(
        "ckptstore_s3_server" if kind == "s3" else "ckptstore_gcs_server"
    )
    bucket = request.getfixturevalue(
        "ckptstore_s3_bucket" if kind == "s3" else "ckptstore_gcs_bucket"
    )
    return kind, bucket, server.endpoint


def save_step_1(kind: str, bucket: str, endpoint: str) -> None:
    async def save() -> None:
        async with make(kind, bucket, endpoint) as b:  # closed: no stray HTTP session
            await ckptstore.save(b, TREE, step=1)

    asyncio.run(save())


@pytest.fixture
def saved(store: tuple[str, str, str]) -> tuple[str, str, str]:
    """`store`, step 1 committed there."""
    save_step_1(*store)
    return store


async def ends_typed(work: Callable[[], Awaitable[Any]]) -> float:
    """Seconds ``work`` took to raise a transient storage error (it must)."""
    start = time.monotonic()
    with pytest.raises(TransientStorageError):
        await work()
    return time.monotonic() - start


async def ends_unreadable(backend: Backend) -> float:
    """Seconds ``verify`` took to report the step unreadable (not corrupt: it must)."""
    start = time.monotonic()
    report = await ckptstore.verify(backend, step=1)
    assert report.unreadable and not report.problems
    return time.monotonic() - start


async def test_closed_port(store: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    kind, bucket, _ = store
    dead = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", dead)
    async with make(kind, bucket, dead, **FAST) as b:
        assert await ends_typed(lambda: ckptstore.save(b, TREE, step=2)) < BOUND
        assert await ends_typed(lambda: ckptstore.restore(b, step=1)) < BOUND
        assert await ends_unreadable(b) < BOUND


class _SplitS3(S3Backend):
    """The byte API reaches the server; TensorStore's requests go to ``ts_endpoint``."""

    ts_endpoint = ""

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        return {**super().kvstore_spec(prefix), "endpoint": self.ts_endpoint}


class _SplitGcs(GcsBackend):
    """The byte API reaches the server; TensorStore's go to ``$TENSORSTORE_GCS_HTTP_URL``."""

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        path = join(self.root, prefix) if prefix else self.root
        return {"driver": "gcs", "bucket": self.bucket, "path": f"{path}/"}


async def test_closed_port_for_tensorstore_only(
    saved: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections refused to TensorStore alone: its retries run out, the error is typed."""
    kind, bucket, endpoint = saved
    dead = f"http://127.0.0.1:{closed_port()}"
    b: Backend
    if kind == "s3":
        b = _SplitS3(bucket, "run", endpoint_url=endpoint, credentials="env", retry=POLICY)
        b.ts_endpoint = dead
    else:
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", dead)
        b = _SplitGcs(
            bucket,
            "run",
            endpoint_url=endpoint,
            credentials="anonymous",
            retry=POLICY,
            emulator=True,
        )
    async with b:
        assert await ends_typed(lambda: ckptstore.save(b, TREE, step=2)) < BOUND
        assert await ends_typed(lambda: ckptstore.restore(b, step=1)) < BOUND
        assert await ends_unreadable(b) < BOUND
        assert await ckptstore.list_steps(b) == [1]  # the failed save committed nothing


async def test_black_hole_for_the_byte_api(
    store: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request accepted and never answered: the clients' read timeouts end it."""
    kind, bucket, endpoint = store
    with FaultProxy(endpoint, [Fault("blackhole", rate=1.0)]) as proxy:
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.endpoint)
        async with make(kind, bucket, proxy.endpoint, **FAST) as b:
            assert await ends_typed(lambda: ckptstore.save(b, TREE, step=2)) < BOUND
            assert await ends_typed(lambda: ckptstore.restore(b, step=1)) < BOUND
            assert await ends_unreadable(b) < BOUND
        assert proxy.injected["blackhole"] > 0  # (a connect timeout under load may come first)


async def test_a_black_hole_fails_at_the_deadline_not_after_every_read_timeout(
    store: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default 60 s read timeout and six attempts would wait six minutes; the retry
    policy's deadline (2 s here, 120 s by default) ends each operation in time, typed."""
    kind, bucket, endpoint = store
    policy = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, deadline=2.0)
    with FaultProxy(endpoint, [Fault("blackhole", rate=1.0)]) as proxy:
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.endpoint)
        async with make(kind, bucket, proxy.endpoint, retry=policy) as b:
            start = time.monotonic()
            with pytest.raises(ckptstore.RetriesExhaustedError, match="deadline"):
                await ckptstore.save(b, TREE, step=2)
            assert time.monotonic() - start < 2.0 + BOUND
            start = time.monotonic()
            with pytest.raises(ckptstore.RetriesExhaustedError, match="deadline"):
                await ckptstore.restore(b, step=1)
            assert time.monotonic() - start < 2.0 + BOUND


def test_the_deadline_allows_for_the_bytes_moved() -> None:
    policy = RetryPolicy(deadline=100.0, min_rate=1 << 20)
    assert policy.limit() == 100.0 and policy.limit(50 << 20) == 150.0
    assert RetryPolicy(deadline=None).limit(1 << 40) is None
    for bad in ({"deadline": 0}, {"deadline": float("inf")}, {"min_rate": -1}, {"deadline": "1"}):
        with pytest.raises(ConfigError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def run_worker(mode: str, stores: list[dict[str, str]]) -> list[dict[str, Any]]:
    """`timeout_worker` in a process of its own, TensorStore's stall timeout at 1 s."""
    env = {**os.environ, "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "campaigns" / "timeout_worker.py"),
            mode,
            json.dumps(stores),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.fixture
def tensorstore_black_holes(
    ckptstore_s3_server: Any,
    ckptstore_s3_bucket: str,
    ckptstore_gcs_server: Any,
    ckptstore_gcs_bucket: str,
) -> Iterator[list[dict[str, str]]]:
    """A proxy per emulator that black-holes TensorStore's requests only (step 1 saved)."""
    stores, proxies = [], []
    try:
        for kind, server, bucket in (
            ("s3", ckptstore_s3_server, ckptstore_s3_bucket),
            ("gcs", ckptstore_gcs_server, ckptstore_gcs_bucket),
        ):
            save_step_1(kind, bucket, server.endpoint)
            rule = Fault("blackhole", rate=1.0, agent="^tensorstore")
            proxy = FaultProxy(server.endpoint, [rule])
            proxy.start()
            proxies.append(proxy)
            stores.append({"kind": kind, "bucket": bucket, "endpoint": proxy.endpoint})
        yield stores
    finally:
        for proxy in proxies:
            proxy.stop()
    assert all(p.injected["blackhole"] > 0 for p in proxies)


def test_black_hole_for_tensorstore_requests(
    tensorstore_black_holes: list[dict[str, str]],
) -> None:
    """A TensorStore read and write that are never answered end, typed, in bounded time."""
    lines = run_worker("kv", tensorstore_black_holes)
    assert sorted((r["store"], r["op"]) for r in lines) == [
        (kind, op) for kind in ("gcs", "s3") for op in ("read", "write")
    ]
    for r in lines:
        assert r["typed"] and r["error"] == "RetriesExhaustedError", r
        assert "DEADLINE_EXCEEDED" in r["message"] or "Timeout" in r["message"], r
        assert r["seconds"] < BOUND, r


@pytest.mark.skipif(
    os.environ.get("CKPTSTORE_FAULTS_FULL") != "1", reason="set CKPTSTORE_FAULTS_FULL=1 (~30 s)"
)
def test_black_hole_for_tensorstore_in_save_restore_verify(
    tensorstore_black_holes: list[dict[str, str]],
) -> None:
    """Save, restore and verify, TensorStore's requests alone never answered."""
    lines = run_worker("save", tensorstore_black_holes)
    assert [(r["store"], r["op"]) for r in lines] == [
        (kind, op) for kind in ("s3", "gcs") for op in ("save", "restore", "verify", "list_steps")
    ]
    for r in lines:
        assert r["seconds"] < BOUND, r
        if r["op"] in ("save", "restore"):
            assert r["typed"] and r["error"] == "RetriesExhaustedError", r
        elif r["op"] == "verify":  # a report, not an error: unreadable, not corrupt
            assert r["error"] is None and r["unreadable"] and not r["problems"], r
        else:  # the byte API still works: the failed save committed nothing
            assert r["error"] is None and r["steps"] == [1], r


def test_timeout_and_retry_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timeouts are options (profiles too); TensorStore's context carries the backend's retry
    policy; its stall timeout defaults to 60 s unless the environment says otherwise."""
    b = ckptstore.open_backend(
        "s3://bucket-x/p",
        endpoint="http://127.0.0.1:1",
        connect_timeout=2,
        read_timeout=5,
        retry={"max_attempts": 4, "base_delay": 0.1, "max_delay": 2.0},
    )
    assert isinstance(b, S3Backend) and (b.connect_timeout, b.read_timeout) == (2.0, 5.0)
    monkeypatch.delenv(TS_STALL_ENV, raising=False)
    retries = b.ts_context.spec.to_json()["s3_request_retries"]
    assert retries == {"max_retries": 3, "initial_delay": "100ms", "max_delay": "2s"}
    assert os.environ[TS_STALL_ENV] == "60"
    monkeypatch.setenv(TS_STALL_ENV, "7")
    GcsBackend("bucket-x", endpoint_url="http://127.0.0.1:1").ts_context  # noqa: B018
    assert os.environ[TS_STALL_ENV] == "7"
    for bad in (0, -1, "5", True):
        with pytest.raises(ConfigError, match="read_timeout"):
            S3Backend("bucket-x", read_timeout=bad)  # type: ignore[arg-type]


@pytest.fixture
def black_hole() -> Iterator[str]:
    """``http://HOST:PORT`` of a listener that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def test_the_deadline_bounds_tensorstore_requests_too(
    ckptstore_s3_server: Any, ckptstore_s3_bucket: str, black_hole: str
) -> None:
    """TensorStore's requests alone go to a black hole: its curl stall timer (60 s a try
    unless set) would hold each for minutes; the policy's 2 s deadline ends save and
    restore, typed, and cancels TensorStore's requests."""
    endpoint = ckptstore_s3_server.endpoint
    save_step_1("s3", ckptstore_s3_bucket, endpoint)
    policy = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, deadline=2.0)
    b = _SplitS3(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env", retry=policy)
    b.ts_endpoint = black_hole

    async def run() -> None:
        async with b:
            for work in (
                lambda: ckptstore.save(b, TREE, step=2),
                lambda: ckptstore.restore(b, step=1),
            ):
                start = time.monotonic()
                with pytest.raises(ckptstore.RetriesExhaustedError, match="deadline"):
                    await work()
                assert time.monotonic() - start < 2.0 + BOUND
            assert await ckptstore.list_steps(b) == [1]  # the failed save committed nothing

    asyncio.run(run())
