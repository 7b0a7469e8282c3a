"""Faults on the data path: TensorStore's own requests, through `FaultProxy`, on moto S3 and
fake-gcs-server.

A failure of the storage (503, a dropped connection, 403) is a typed storage error, retried
under the backend's one `RetryPolicy`; only bad data is `CorruptCheckpointError`, and
``verify`` tells the two apart (``unreadable`` vs ``problems``; exit 3 vs 1).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends._errors import redact_text
from ckptstore.backends.base import Backend
from ckptstore.backends.s3 import S3Backend
from ckptstore.cli import main
from ckptstore.datapath.reads import open_leaf
from ckptstore.errors import (
    AlreadyExistsError,
    CorruptCheckpointError,
    PermissionDeniedError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.format.leaves import describe_leaf
from ckptstore.testing.faultproxy import Fault, FaultProxy
from tests.bits import same
from tests.campaigns.proxied import POLICY, Make

TS = "^tensorstore"  # TensorStore's User-Agent: its own requests, not the byte API's


def tree() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    w = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),  # 8 chunks
        "b": np.linspace(-1, 1, 300).astype(np.float16),  # small: one batched read
        "step": 7,
    }


def ts_tries(proxy: FaultProxy) -> Counter[str]:
    """TensorStore requests per (method, path) so far (without the query: TensorStore's GCS
    driver adds a random one to each request)."""
    return Counter(
        f"{s.method} {s.path.split('?')[0]}"
        for s in proxy.seen
        if s.agent.startswith("tensorstore")
    )


async def one_read_tries(backend: Backend, proxy: FaultProxy) -> int:
    """How many requests one failing TensorStore read of one key makes."""
    proxy.reset_counts()
    kv = await ts.KvStore.open(backend.kvstore_spec(""), context=backend.ts_context)
    with pytest.raises(ValueError):
        await kv.read("some/key")
    (tries,) = ts_tries(proxy).values()
    return tries


async def test_tensorstore_requests_retry_under_the_backend_policy(
    behind_proxy: tuple[FaultProxy, Make],
) -> None:
    proxy, make = behind_proxy
    expected = tree()
    async with make() as backend:
        await ckptstore.save(backend, expected, step=1)
        assert ts_tries(proxy), "TensorStore's requests did not go through the proxy"

        # two failures in a row: TensorStore's retries (the backend's policy) absorb them
        proxy.set_faults(Fault("status", nth=frozenset({1, 2}), agent=TS))
        proxy.reset_counts()
        assert same(await ckptstore.restore(backend, step=1), expected)
        assert proxy.injected == {"status": 2}

        # every TensorStore request fails: a typed, transient error after max_attempts tries
        proxy.set_faults(Fault("status", rate=1.0, agent=TS))
        proxy.reset_counts()
        with pytest.raises(RetriesExhaustedError, match=r"All 2 retry attempts failed"):
            await ckptstore.restore(backend, step=1)
        # one read is max_attempts requests (a restore makes several reads of one manifest)
        assert await one_read_tries(backend, proxy) == POLICY.max_attempts

        # connections dropped: the same (curl may resend once on a fresh connection itself)
        proxy.set_faults(Fault("drop", rate=1.0, agent=TS))
        with pytest.raises(RetriesExhaustedError, match="Empty reply from server"):
            await ckptstore.restore(backend, step=1)


async def test_permission_denied_is_typed_and_not_retried(
    behind_proxy: tuple[FaultProxy, Make],
) -> None:
    proxy, make = behind_proxy
    async with make() as backend:
        await ckptstore.save(backend, tree(), step=1)
        proxy.set_faults(Fault("status", status=403, rate=1.0, agent=TS))
        proxy.reset_counts()
        with pytest.raises(PermissionDeniedError, match="PERMISSION_DENIED"):
            await ckptstore.restore(backend, step=1)
        assert await one_read_tries(backend, proxy) == 1
        with pytest.raises(PermissionDeniedError):  # a save's data writes, too
            await ckptstore.save(backend, tree(), step=2)
        proxy.set_faults()
        assert await ckptstore.list_steps(backend) == [1]


async def test_verify_tells_unreadable_storage_from_corrupt_data(
    behind_proxy: tuple[FaultProxy, Make], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    proxy, make = behind_proxy
    async with make() as backend:
        await ckptstore.save(backend, tree(), step=1)
        profile = tmp_path / "p.toml"
        credentials = "env" if backend.kind == "s3" else "anonymous"
        profile.write_text(
            f'url = "{backend.url}"\n[options]\nendpoint = "{proxy.endpoint}"\n'
            f'credentials = "{credentials}"\n[options.retry]\nmax_attempts = 2\n'
            "base_delay = 0.01\n"
        )
        cli = ["--profile", str(profile), "verify"]

        proxy.set_faults(Fault("status", status=503, rate=1.0, agent=TS))
        report = await ckptstore.verify(backend, step=1)
        assert report.unreadable and not report.problems and not report.ok
        assert all("503" in why for why in report.unreadable.values())
        capsys.readouterr()
        assert await asyncio.to_thread(main, cli) == 3
        out = capsys.readouterr().out
        assert "UNREADABLE" in out and "CORRUPT" not in out

        # the byte API failing (every request, not only TensorStore's) is exit 3 too
        proxy.set_faults(Fault("status", status=503, rate=1.0))
        assert await asyncio.to_thread(main, cli) == 3
        assert "503" in capsys.readouterr().err

        # real damage: one byte of the largest data file flipped (exit 1: tests/cli/test_cli.py)
        proxy.set_faults()
        infos = [i async for i in backend.list("1")]
        data = max(infos, key=lambda i: i.size)
        raw = bytearray(await backend.read(data.key))
        raw[len(raw) // 2] ^= 0xFF
        await backend.write(data.key, bytes(raw))
        report = await ckptstore.verify(backend, step=1)
        assert report.problems and not report.unreadable
        with pytest.raises(CorruptCheckpointError):
            await ckptstore.restore(backend, step=1)


async def test_tensorstore_error_texts_are_redacted(
    ckptstore_s3_server: Any, ckptstore_s3_bucket: str
) -> None:
    """TensorStore quotes the whole spec, endpoint and all, in some errors; never shown.

    (A backend refuses an endpoint with ``user:password@``, so the spec is edited here
    to reach TensorStore with one: the redaction of its texts is the last line.)"""
    endpoint = ckptstore_s3_server.endpoint.replace("http://", "http://user:s3cr3t@")
    backend = S3Backend(
        ckptstore_s3_bucket,
        "run",
        endpoint_url=ckptstore_s3_server.endpoint,
        credentials="env",
        retry=POLICY,
    )
    spec = {**backend.kvstore_spec("nothing"), "endpoint": endpoint}
    info = describe_leaf("missing", np.zeros(4, np.float32))
    with pytest.raises(CorruptCheckpointError) as caught:
        await open_leaf(spec, backend.ts_context, info)
    assert "does not exist" in str(caught.value)
    assert "s3cr3t" not in str(caught.value)


def test_redact_text() -> None:
    text = (
        "GET http://u:p@ss/w0rd@host:1/b?X-Amz-Signature=abc123&x=1 failed; "
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIA/x; Bearer ya29.tok-en "
        "gs://bucket/key?access_token=zzz"
    )
    out = redact_text(text)
    for secret in ("p@ss", "w0rd", "abc123", "AWS4-HMAC", "ya29", "zzz"):
        assert secret not in out, out
    assert "host:1/b" in out and "x=1" in out and "gs://bucket/key" in out


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("UNAVAILABLE: CURL error Could not connect", TransientStorageError),
        ("DEADLINE_EXCEEDED: Timed out", TransientStorageError),
        ('ABORTED: Error reading "k": All 5 retry attempts failed: x', RetriesExhaustedError),
        ("PERMISSION_DENIED: AccessDenied", PermissionDeniedError),
        (
            "RESOURCE_EXHAUSTED: Failed to write 8 bytes to file 7: No space left on device",
            ckptstore.InsufficientSpaceError,
        ),
        (
            "RESOURCE_EXHAUSTED: Failed to write 8 bytes to file 7: Disk quota exceeded",
            ckptstore.InsufficientSpaceError,
        ),
        ("RESOURCE_EXHAUSTED: SlowDown", TransientStorageError),
        ("DATA_LOSS: checksum mismatch", CorruptCheckpointError),
        ('NOT_FOUND: Error reading "d/1": missing', CorruptCheckpointError),
        ("Error decoding chunk", CorruptCheckpointError),
    ],
)
def test_read_errors_by_status_code(text: str, kind: type[Exception]) -> None:
    from ckptstore.backends.tserrors import write_error
    from ckptstore.datapath.reads import read_error

    error = read_error(ValueError(text), "leaf")
    assert type(error) is kind
    if kind is CorruptCheckpointError:
        assert isinstance(write_error(ValueError(text), "x"), StorageError)


async def test_a_failed_write_cancels_and_awaits_the_save_s_other_writes(
    ckptstore_s3_server: Any, ckptstore_s3_bucket: str
) -> None:
    """When one of a save's writes fails for good, every other write of the save is cancelled
    and has ended before the error is raised: none runs on, racing whatever the caller does
    next (a retry, a cleanup of the attempt)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    big = NamedSharding(mesh, P("x", "y"))
    tree = {f"l{i}": jax.device_put(np.full((64, 64), i, np.float32), big) for i in range(12)}
    tree |= {f"s{i}": np.arange(100) + i for i in range(12)}  # small leaves: batched writes
    with FaultProxy(ckptstore_s3_server.endpoint) as proxy:
        backend = S3Backend(
            ckptstore_s3_bucket, "run", endpoint_url=proxy.endpoint, credentials="env", retry=POLICY
        )
        async with backend:
            proxy.set_faults(
                Fault(
                    "status", status=403, nth=frozenset({3}), methods=frozenset({"PUT"}), agent=TS
                ),
                Fault("latency", delay=0.1, rate=1.0, agent=TS),  # keep writes in flight
            )
            with pytest.raises(PermissionDeniedError):
                await ckptstore.save(backend, tree, step=1)
            failed_at = time.monotonic()
            running = [
                t
                for t in asyncio.all_tasks()
                if "LeafWriter." in getattr(t.get_coro(), "__qualname__", "")
            ]
            assert running == []
            await asyncio.sleep(0.5)
            late = [s for s in proxy.seen if s.at > failed_at and s.agent.startswith("tensorstore")]
            assert late == []
            proxy.set_faults()
            assert await ckptstore.list_steps(backend) == []


async def test_a_declared_save_whose_chunk_writes_fail_commits_nothing(
    ckptstore_s3_server: Any, ckptstore_s3_bucket: str
) -> None:
    """A declared save writes its changed chunks while it hashes the others
    (`datapath.declaredwrites`): a write refused for good fails it typed, once every write
    it issued has ended; the step is not committed and the base restores as it was."""
    values = np.random.default_rng(0).standard_normal((512, 64), dtype=np.float32)
    later = values.copy()
    rows = [3, 100, 200, 300, 400]
    later[rows] += 1.0
    with FaultProxy(ckptstore_s3_server.endpoint) as proxy:
        backend = S3Backend(
            ckptstore_s3_bucket, "run", endpoint_url=proxy.endpoint, credentials="env", retry=POLICY
        )
        async with backend:
            first = await ckptstore.save(backend, {"t": values}, step=1, chunk_bytes=4096)
            proxy.set_faults(
                Fault(
                    "status", status=403, nth=frozenset({2}), methods=frozenset({"PUT"}), agent=TS
                ),
                Fault("latency", delay=0.05, rate=1.0, agent=TS),  # keep writes in flight
            )
            with pytest.raises(PermissionDeniedError):
                await ckptstore.save(
                    backend, {"t": later}, step=2, base=first, changed={"t": rows}, chunk_bytes=4096
                )
            failed_at = time.monotonic()
            await asyncio.sleep(0.3)
            late = [s for s in proxy.seen if s.at > failed_at and s.agent.startswith("tensorstore")]
            assert late == []
            proxy.set_faults()
            assert await ckptstore.list_steps(backend) == [1]
            assert same((await ckptstore.restore(backend, 1))["t"], values)


async def test_create_whose_reply_was_lost_is_recognised(
    ckptstore_s3_server: Any, ckptstore_s3_bucket: str
) -> None:
    """The marker's PUT landed but its reply was lost; aiohttp resends the PUT itself (within
    one attempt), which meets the marker: our own bytes, so the create succeeded."""
    with FaultProxy(ckptstore_s3_server.endpoint) as proxy:
        backend = S3Backend(
            ckptstore_s3_bucket, "run", endpoint_url=proxy.endpoint, credentials="env", retry=POLICY
        )
        async with backend:
            proxy.set_faults(Fault("lost_reply", nth=frozenset({1}), methods=frozenset({"PUT"})))
            await backend.create("1/COMMITTED", b"token-123")
            assert proxy.injected == {"lost_reply": 1}
            assert await backend.read("1/COMMITTED") == b"token-123"
            with pytest.raises(AlreadyExistsError):
                await backend.create("1/COMMITTED", b"someone else")
