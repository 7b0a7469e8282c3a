"""`Backend.check_root`: a missing root (directory, bucket) is an error; an empty one is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.backends.base import Backend
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import NotFoundError
from ckptstore.testing.servers import FakeGcsServer, MotoS3Server


async def test_an_existing_root_passes_empty_or_not(any_backend: Backend) -> None:
    if not isinstance(any_backend, LocalBackend):
        await any_backend.check_root()  # an empty prefix of an existing bucket exists
    await any_backend.write("a/b", b"x")
    await any_backend.check_root()


async def test_a_missing_or_non_directory_local_root(tmp_path: Path) -> None:
    async with LocalBackend(tmp_path / "nothing") as missing:
        with pytest.raises(NotFoundError, match=r"no such directory .*nothing"):
            await missing.check_root()
    (tmp_path / "file").write_bytes(b"x")
    async with LocalBackend(tmp_path / "file") as file:
        with pytest.raises(NotFoundError, match="file is not a directory"):
            await file.check_root()


async def test_a_missing_s3_bucket(ckptstore_s3_server: MotoS3Server) -> None:
    async with S3Backend(
        "no-such-bucket", "run", endpoint_url=ckptstore_s3_server.endpoint, credentials="env"
    ) as b:
        with pytest.raises(NotFoundError, match="bucket 'no-such-bucket' does not exist at http"):
            await b.check_root()


async def test_a_missing_gcs_bucket(ckptstore_gcs_server: FakeGcsServer) -> None:
    async with GcsBackend(
        "no-such-bucket",
        "run",
        endpoint_url=ckptstore_gcs_server.endpoint,
        credentials="anonymous",
        emulator=True,
    ) as b:
        with pytest.raises(NotFoundError, match="bucket 'no-such-bucket' does not exist at http"):
            await b.check_root()
