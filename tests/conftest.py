"""Shared fixtures: ``any_backend`` runs a test on local disk, memory, S3 (moto) and GCS."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# Several tests need more than one CPU device; set before jax initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from ckptstore.backends.base import Backend
from ckptstore.backends.retry import RetryPolicy


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests (marked ``slow``, each 30 s or more) first: the workers start them
    together while the short ones fill the gaps after, instead of one of them starting last
    and holding up the end of the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


BACKENDS = ["local", "memory", "s3", "gcs"]
FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.1)


async def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if kind == "local":
        from ckptstore.backends.local import LocalBackend

        return LocalBackend(tmp_path / "ckpt")
    if kind == "memory":
        from ckptstore.backends.memory import MemoryBackend

        return MemoryBackend()
    if kind == "s3":
        from ckptstore.backends.s3 import S3Backend

        server = request.getfixturevalue("ckptstore_s3_server")
        bucket = request.getfixturevalue("ckptstore_s3_bucket")
        return S3Backend(
            bucket, "ckpt", endpoint_url=server.endpoint, credentials="env", retry=FAST_RETRY
        )
    if kind == "gcs":
        from ckptstore.backends.gcs import GcsBackend

        server = request.getfixturevalue("ckptstore_gcs_server")
        bucket = request.getfixturevalue("ckptstore_gcs_bucket")
        return GcsBackend(
            bucket,
            "ckpt",
            endpoint_url=server.endpoint,
            credentials="anonymous",
            emulator=True,
            retry=FAST_RETRY,
        )
    raise ValueError(kind)


@pytest.fixture(params=BACKENDS)
async def any_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    backend = await make_backend(request.param, request, tmp_path)
    async with backend:
        yield backend
