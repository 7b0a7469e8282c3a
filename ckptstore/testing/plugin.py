"""pytest plugin: S3 and GCS emulators for any test suite (registered as ``ckptstore``).

Installing ckptstore registers this plugin through the ``pytest11`` entry
point, so these fixtures are available without any ``conftest.py``:

- ``moto_server`` (session): a `MotoS3Server` on 127.0.0.1. Sets
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` to ``testing`` and
  ``AWS_DEFAULT_REGION`` to ``us-east-1`` (and unsets ``AWS_PROFILE`` /
  ``AWS_SESSION_TOKEN``) for the session, so boto, s3fs and TensorStore's
  ``{"type": "environment"}`` credentials all reach it.
- ``fake_gcs_server`` (session): a `FakeGcsServer`. Sets
  ``STORAGE_EMULATOR_HOST`` (gcsfs, google-cloud-storage) and
  ``TENSORSTORE_GCS_HTTP_URL`` (TensorStore) to its endpoint.
- ``s3_bucket`` / ``gcs_bucket`` (function): a freshly created, empty bucket
  name on the corresponding server, unique per test.

Servers start lazily, only in sessions that request them, and stop at the end
of the session (the environment is restored). Example::

    import pytest
    from ckptstore.backends.s3 import S3Backend

    @pytest.fixture
    async def backend(moto_server, s3_bucket):
        async with S3Backend(s3_bucket, "ckpt", endpoint_url=moto_server.endpoint,
                             credentials="env") as b:
            yield b

    async def test_roundtrip(backend):
        await backend.write("k", b"v")
        assert await backend.read("k") == b"v"

GCS backends use ``GcsBackend(gcs_bucket, endpoint_url=fake_gcs_server.endpoint,
credentials="anonymous")``. Note that fake-gcs-server does not enforce
preconditions, so create-if-absent races are not decided by the server there.

Importing this module sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (unless
already set): gcsfs reads it at import time, and its experimental mode stalls
~60 s per operation against an emulator.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ckptstore.testing.servers import MOTO_KEY, MOTO_REGION, FakeGcsServer, MotoS3Server

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    """moto's S3 server for the session, with the AWS environment pointed at test credentials."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", MOTO_KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", MOTO_KEY)
        env.setenv("AWS_DEFAULT_REGION", MOTO_REGION)
        env.delenv("AWS_SESSION_TOKEN", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        with MotoS3Server() as server:
            yield server


@pytest.fixture(scope="session")
def fake_gcs_server() -> Iterator[FakeGcsServer]:
    """fake-gcs-server for the session, with gcsfs and TensorStore pointed at it."""
    with FakeGcsServer() as server, pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        env.setenv("TENSORSTORE_GCS_HTTP_URL", server.endpoint)
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoS3Server) -> str:
    """A new, empty bucket on the moto server."""
    return moto_server.create_bucket()


@pytest.fixture
def gcs_bucket(fake_gcs_server: FakeGcsServer) -> str:
    """A new, empty bucket on fake-gcs-server."""
    return fake_gcs_server.create_bucket()
