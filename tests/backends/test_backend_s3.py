"""S3Backend against moto's S3 server over real HTTP: the conformance suite plus S3 specifics."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.backends.retry import NO_RETRY, RetryPolicy
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.testing.conformance import BackendTests
from ckptstore.testing.servers import MotoS3Server

MiB = 1 << 20
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01)


def make(server: MotoS3Server, bucket: str, prefix: str = "root/dir", **kw: Any) -> S3Backend:
    kw.setdefault("credentials", "env")
    kw.setdefault("retry", FAST_RETRY)
    return S3Backend(bucket, prefix, endpoint_url=server.endpoint, **kw)


class TestS3Backend(BackendTests):
    @pytest.fixture
    async def backend(
        self, ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
    ) -> AsyncIterator[S3Backend]:
        async with make(ckptstore_s3_server, ckptstore_s3_bucket) as b:
            yield b


@pytest.fixture
async def s3(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> AsyncIterator[S3Backend]:
    async with make(ckptstore_s3_server, ckptstore_s3_bucket) as b:
        yield b


async def raw(backend: S3Backend, method: str, **kw: Any) -> Any:
    """Call the S3 API directly (bypassing the backend's key handling)."""
    return await backend._call("test", None, method, **kw)


# ---- layout -----------------------------------------------------------------------------------


async def test_keys_live_under_the_prefix(s3: S3Backend) -> None:
    await s3.write("a/b", b"x")
    listed = await raw(s3, "list_objects_v2", Prefix="")
    assert [o["Key"] for o in listed["Contents"]] == ["root/dir/a/b"]
    assert s3.url == f"s3://{s3.bucket}/root/dir"


async def test_bucket_root_backend(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    async with make(ckptstore_s3_server, ckptstore_s3_bucket, prefix="") as b:
        await b.write("top", b"1")
        await b.write("d/x", b"2")
        assert [i.key async for i in b.list()] == ["d/x", "top"]
        assert await b.list_dir() == ["d", "top"]
        assert b.url == f"s3://{ckptstore_s3_bucket}"
        assert b.kvstore_spec()["path"] == ""
        assert b.kvstore_spec("d")["path"] == "d/"


# ---- multipart --------------------------------------------------------------------------------


async def test_large_write_uses_multipart(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    async with make(
        ckptstore_s3_server, ckptstore_s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB
    ) as b:
        data = os.urandom(12 * MiB + 7)
        await b.write("big", data)
        assert await b.read("big") == data
        assert await b.read("big", 5 * MiB - 3, 5 * MiB + 3) == data[5 * MiB - 3 : 5 * MiB + 3]
        head = await raw(b, "head_object", Key="root/dir/big")
        assert head["ETag"].strip('"').endswith("-3")  # a 3-part multipart object
        small = os.urandom(MiB)
        await b.write("small", small)
        head = await raw(b, "head_object", Key="root/dir/small")
        assert "-" not in head["ETag"]  # a single PutObject


async def test_large_create_is_conditional(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    async with make(
        ckptstore_s3_server, ckptstore_s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB
    ) as b:
        first, second = os.urandom(6 * MiB), os.urandom(6 * MiB)
        await b.create("big-marker", first)
        with pytest.raises(AlreadyExistsError):
            await b.create("big-marker", second)
        assert await b.read("big-marker") == first
        uploads = await raw(b, "list_multipart_uploads")
        assert not uploads.get("Uploads")


async def test_large_create_loses_race_at_completion(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    """If the key appears during the upload, CompleteMultipartUpload's If-None-Match refuses."""
    async with make(
        ckptstore_s3_server, ckptstore_s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB
    ) as b:
        real_call = b._call

        async def sneaky(op: str, key: str | None, method: str, **kw: Any) -> Any:
            if method == "complete_multipart_upload":
                await raw(b, "put_object", Key="root/dir/m", Body=b"winner")
            return await real_call(op, key, method, **kw)

        b._call = sneaky  # type: ignore[method-assign]
        with pytest.raises(AlreadyExistsError):
            await b.create("m", os.urandom(6 * MiB))
        b._call = real_call  # type: ignore[method-assign]
        assert await b.read("m") == b"winner"
        assert not (await raw(b, "list_multipart_uploads")).get("Uploads")


async def test_failed_multipart_is_aborted(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    async with make(
        ckptstore_s3_server,
        ckptstore_s3_bucket,
        multipart_threshold=5 * MiB,
        part_size=5 * MiB,
        retry=NO_RETRY,
    ) as b:
        real_call = b._call

        async def failing(op: str, key: str | None, method: str, **kw: Any) -> Any:
            if method == "upload_part" and kw["PartNumber"] == 2:
                raise StorageError("boom", backend=b.url, key=key)
            return await real_call(op, key, method, **kw)

        b._call = failing  # type: ignore[method-assign]
        with pytest.raises(StorageError, match="boom"):
            await b.write("big", os.urandom(11 * MiB))
        b._call = real_call  # type: ignore[method-assign]
        assert not (await raw(b, "list_multipart_uploads")).get("Uploads")
        assert not await b.exists("big")


# ---- create races -----------------------------------------------------------------------------


async def test_create_race_has_one_winner_repeatedly(s3: S3Backend) -> None:
    """Several rounds of 16 racing creators: exactly one wins each round, on the server's word."""
    for round_ in range(5):
        results = await asyncio.gather(
            *(s3.create(f"race-{round_}", f"w{i}".encode()) for i in range(16)),
            return_exceptions=True,
        )
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1, results
        assert all(isinstance(r, AlreadyExistsError) for r in results if r is not None), results
        assert await s3.read(f"race-{round_}") == f"w{winners[0]}".encode()


async def test_create_race_stays_atomic_when_moto_stores_slowly(
    s3: S3Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto looks a conditional write's key up, then stores it; the test server makes the two
    one step. Widened here by a slow store, 8 racers would otherwise all be told they won."""
    from moto.s3.models import S3Backend as MotoBackend

    real_put = MotoBackend.put_object

    def slow_put(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(MotoBackend, "put_object", slow_put)
    results = await asyncio.gather(
        *(s3.create("slow-race", f"w{i}".encode()) for i in range(8)), return_exceptions=True
    )
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1, results
    assert await s3.read("slow-race") == f"w{winners[0]}".encode()


# ---- credential sources -------------------------------------------------------------------


@pytest.mark.parametrize("source", ["default", "profile"])
async def test_credential_sources_reach_moto(
    ckptstore_s3_server: MotoS3Server,
    ckptstore_s3_bucket: str,
    source: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profile = None
    if source == "profile":
        creds = tmp_path / "credentials"
        creds.write_text("[ckpt-test]\naws_access_key_id = testing\naws_secret_access_key = x\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
        profile = "ckpt-test"
    async with make(
        ckptstore_s3_server, ckptstore_s3_bucket, credentials=source, profile=profile
    ) as b:
        await b.write("k", source.encode())
        assert await b.read("k") == source.encode()


async def test_anonymous_read_of_private_object_is_permission_denied(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str
) -> None:
    """Unsigned requests reach moto; its 403 for a private object maps to PermissionDeniedError."""
    async with make(ckptstore_s3_server, ckptstore_s3_bucket) as signed:
        await signed.write("private", b"x")
    async with make(
        ckptstore_s3_server, ckptstore_s3_bucket, credentials="anonymous", retry=NO_RETRY
    ) as anon:
        with pytest.raises(PermissionDeniedError, match="403"):
            await anon.read("private")


async def test_unknown_profile_is_config_error(
    ckptstore_s3_server: MotoS3Server,
    ckptstore_s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    async with make(
        ckptstore_s3_server, ckptstore_s3_bucket, credentials="profile", profile="nope"
    ) as b:
        with pytest.raises(ConfigError, match="nope"):
            await b.read("k")


# ---- errors -----------------------------------------------------------------------------------


async def test_missing_bucket_is_not_found(ckptstore_s3_server: MotoS3Server) -> None:
    async with make(ckptstore_s3_server, "no-such-bucket-here", retry=NO_RETRY) as b:
        with pytest.raises(NotFoundError) as info:
            await b.read("k")
        assert "NoSuchBucket" in str(info.value)
        assert "s3://no-such-bucket-here" in str(info.value)
        with pytest.raises(NotFoundError):
            await b.write("k", b"x")
        with pytest.raises(NotFoundError):
            [i async for i in b.list()]


async def test_unreachable_endpoint_is_transient() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    b = S3Backend(
        "bkt", endpoint_url=f"http://127.0.0.1:{port}", credentials="anonymous", retry=NO_RETRY
    )
    with pytest.raises(TransientStorageError) as info:
        await b.read("k")
    assert "'k'" in str(info.value)
    await b.close()


async def test_env_credentials_missing_is_permission_error(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    async with make(ckptstore_s3_server, ckptstore_s3_bucket, retry=NO_RETRY) as b:
        with pytest.raises(PermissionDeniedError, match="AWS_ACCESS_KEY_ID"):
            await b.read("k")


async def test_secrets_never_shown(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "TOPSECRETvalue1234567890"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    async with make(ckptstore_s3_server, ckptstore_s3_bucket, retry=NO_RETRY) as b:
        await b.write("k", b"v")  # moto does not check signatures: the secret is in use
        with pytest.raises(NotFoundError) as info:
            await b.read("missing")
        shown = [repr(b), b.url, str(info.value), repr(info.value), json.dumps(b.kvstore_spec())]
        assert not any(secret in s for s in shown)
        assert not any(secret in s for s in map(str, vars(b).values()))


async def test_endpoint_userinfo_refused_unechoed() -> None:
    """Credentials never travel inside an endpoint URL (to s3fs, botocore's logs, TensorStore)."""
    with pytest.raises(ConfigError, match="must not carry credentials") as info:
        S3Backend("bkt", endpoint_url="http://user:pw@127.0.0.1:9", credentials="anonymous")
    assert "pw" not in str(info.value)
    assert "127.0.0.1:9" in str(info.value)


def test_invalid_options() -> None:
    with pytest.raises(ConfigError, match="never the secret"):
        S3Backend("b", credentials="AKIA...")
    with pytest.raises(ConfigError):
        S3Backend("b", credentials="profile")
    with pytest.raises(ConfigError):
        S3Backend("b", profile="dev")
    with pytest.raises(ConfigError):
        S3Backend("b", part_size=MiB)
    with pytest.raises(ConfigError):
        S3Backend("bucket/with/slash")


# ---- TensorStore ------------------------------------------------------------------------------


def test_kvstore_spec_credentials() -> None:
    def spec(**kw: Any) -> dict[str, Any]:
        return S3Backend("bkt", "p/q", region="eu-west-1", **kw).kvstore_spec("x")

    assert spec() == {
        "driver": "s3",
        "bucket": "bkt",
        "path": "p/q/x/",
        "aws_region": "eu-west-1",
        "aws_credentials": {"type": "default"},
    }
    assert spec(credentials="env")["aws_credentials"] == {"type": "environment"}
    assert spec(credentials="anonymous")["aws_credentials"] == {"type": "anonymous"}
    assert spec(credentials="profile", profile="dev")["aws_credentials"] == {
        "type": "profile",
        "profile": "dev",
    }
    for kw in ({}, {"credentials": "anonymous"}, {"credentials": "profile", "profile": "p"}):
        ts.KvStore.Spec(spec(**kw))  # TensorStore accepts every form


async def test_zarr3_over_ocdbt_roundtrip(s3: S3Backend) -> None:
    data = np.arange(32 * 48, dtype=np.int32).reshape(32, 48)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": s3.kvstore_spec("ckpt/state")},
    }
    arr = await ts.open(spec, create=True, dtype=ts.int32, shape=data.shape, context=s3.ts_context)
    await arr.write(data)
    keys = [i.key async for i in s3.list("ckpt/state")]
    assert "ckpt/state/manifest.ocdbt" in keys
    reopened = await ts.open(spec, context=s3.ts_context)
    np.testing.assert_array_equal(await reopened.read(), data)


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
async def test_the_standard_endpoint_variable_reaches_bytes_and_arrays(
    ckptstore_s3_server: MotoS3Server,
    ckptstore_s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    """A plain s3:// URL with AWS_ENDPOINT_URL set: s3fs and TensorStore both use it."""
    import numpy as np

    import ckptstore

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # ckptstore_s3_bucket sets one of them
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, ckptstore_s3_server.endpoint)
    url = f"s3://{ckptstore_s3_bucket}/run"
    backend = ckptstore.open_backend(url, credentials="env")
    assert isinstance(backend, S3Backend) and backend.endpoint_url == ckptstore_s3_server.endpoint
    assert backend.kvstore_spec("x")["endpoint"] == ckptstore_s3_server.endpoint
    await backend.close()
    await asyncio.wait_for(ckptstore.save(url, {"w": np.arange(64.0)}, step=3), 120)
    assert await ckptstore.list_steps(url) == [3]
    restored = await asyncio.wait_for(ckptstore.restore(url), 120)
    np.testing.assert_array_equal(restored["w"], np.arange(64.0))
    assert (await ckptstore.verify(url)).ok


@pytest.mark.parametrize("password", ["pa/ss", "p@ss", "p?ss#x", "plainpw"])
def test_endpoint_passwords_never_show(password: str) -> None:
    with pytest.raises(ConfigError) as info:
        S3Backend(
            "bucket", endpoint_url=f"http://someone:{password}@127.0.0.1:9", credentials="env"
        )
    for text in (str(info.value), repr(info.value)):
        assert password not in text and "someone" not in text
    assert "127.0.0.1:9" in str(info.value)
