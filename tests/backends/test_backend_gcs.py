"""GcsBackend against fake-gcs-server over real HTTP: the conformance suite plus GCS specifics."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.backends._errors import error_for
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.registry import open_backend
from ckptstore.backends.retry import NO_RETRY, RetryPolicy
from ckptstore.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.testing.conformance import BackendTests
from ckptstore.testing.servers import FakeGcsServer

MiB = 1 << 20
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01)


def make(server: FakeGcsServer, bucket: str, prefix: str = "root/dir", **kw: Any) -> GcsBackend:
    kw.setdefault("credentials", "anonymous")
    kw.setdefault("emulator", True)
    kw.setdefault("retry", FAST_RETRY)
    return GcsBackend(bucket, prefix, endpoint_url=server.endpoint, **kw)


def make_root(b: GcsBackend) -> GcsBackend:
    assert b.endpoint_url is not None
    return GcsBackend(b.bucket, endpoint_url=b.endpoint_url, credentials="anonymous", emulator=True)


class TestGcsBackend(BackendTests):
    concurrent_create_xfail = (
        "fake-gcs-server ignores ifGenerationMatch; the emulator fallback checks then writes"
    )

    @pytest.fixture
    async def backend(
        self, ckptstore_gcs_server: FakeGcsServer, ckptstore_gcs_bucket: str
    ) -> AsyncIterator[GcsBackend]:
        async with make(ckptstore_gcs_server, ckptstore_gcs_bucket) as b:
            yield b


@pytest.fixture
async def gcs(
    ckptstore_gcs_server: FakeGcsServer, ckptstore_gcs_bucket: str
) -> AsyncIterator[GcsBackend]:
    async with make(ckptstore_gcs_server, ckptstore_gcs_bucket) as b:
        yield b


# ---- layout and identity ----------------------------------------------------------------------


async def test_keys_live_under_the_prefix(gcs: GcsBackend) -> None:
    await gcs.write("a/b", b"x")
    async with make_root(gcs) as root:
        assert [i.key async for i in root.list()] == ["root/dir/a/b"]
    assert gcs.url == f"gs://{gcs.bucket}/root/dir"


def test_emulator_mode_is_explicit(
    ckptstore_gcs_server: FakeGcsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Emulator mode (anonymous, create checks first) only where said: ``emulator=True`` or
    the endpoint of ``$STORAGE_EMULATOR_HOST`` (set by the fixture). Any other endpoint, a
    proxy say, is real GCS: real credentials, the server decides create-if-absent."""
    from_env = GcsBackend("b", credentials="anonymous")
    same = GcsBackend("b", endpoint_url=ckptstore_gcs_server.endpoint)
    assert from_env.emulated and same.emulated and not same.capabilities.conditional_create
    proxy = GcsBackend("b", endpoint_url="http://gcs-proxy.internal:8080")
    assert not proxy.emulated and proxy.capabilities.conditional_create
    assert "emulator" not in repr(proxy) and "emulator" in repr(same)
    assert GcsBackend("b", endpoint_url="http://gcs-proxy.internal:8080", emulator=True).emulated
    assert not GcsBackend("b", emulator=False).emulated  # the variable's endpoint, said real
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    assert not GcsBackend("b", endpoint_url=ckptstore_gcs_server.endpoint).emulated
    real = GcsBackend("b", endpoint_url="https://storage.googleapis.com", credentials="anonymous")
    assert not real.emulated and real.capabilities.conditional_create
    for endpoint in (None, "https://storage.googleapis.com"):
        with pytest.raises(ConfigError, match="emulator mode needs the emulator's endpoint"):
            GcsBackend("b", endpoint_url=endpoint, emulator=True)
    with pytest.raises(ConfigError, match="true or false"):
        GcsBackend("b", endpoint_url=ckptstore_gcs_server.endpoint, emulator="yes")  # type: ignore[arg-type]


def test_emulator_option_in_profiles(ckptstore_gcs_server: FakeGcsServer, tmp_path: Any) -> None:
    profile = tmp_path / "emu.toml"
    profile.write_text(
        'url = "gs://b/run"\n[options]\nendpoint = "http://127.0.0.1:9"\nemulator = true\n'
    )
    assert isinstance(b := open_backend(profile=profile), GcsBackend) and b.emulated
    assert not open_backend(profile=profile, emulator=False).emulated  # type: ignore[attr-defined]


async def test_custom_endpoint_keeps_real_credentials(
    ckptstore_gcs_server: FakeGcsServer,
    ckptstore_gcs_bucket: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-emulator endpoint loads the configured credentials (here a broken service
    account file, refused before any request); emulator mode never does."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    path = tmp_path / "sa.json"
    path.write_text('{"type": "service_account", "private_key": "TOPSECRET"}')
    endpoint = ckptstore_gcs_server.endpoint
    async with GcsBackend(
        ckptstore_gcs_bucket, endpoint_url=endpoint, credentials=str(path)
    ) as proxied:
        with pytest.raises(PermissionDeniedError, match="cannot load GCS credentials") as err:
            await proxied.write("k", b"x")
        assert "check that the key file is a valid" in str(err.value)  # what to do
        assert "TOPSECRET" not in str(err.value)
    async with GcsBackend(
        ckptstore_gcs_bucket, endpoint_url=endpoint, credentials=str(path), emulator=True
    ) as emulated:
        await emulated.write("k", b"x")  # anonymous: the file is never read
        assert await emulated.read("k") == b"x"


async def test_default_credentials_missing_say_what_to_set(
    ckptstore_gcs_server: FakeGcsServer,
    ckptstore_gcs_bucket: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    endpoint = ckptstore_gcs_server.endpoint
    async with GcsBackend(ckptstore_gcs_bucket, endpoint_url=endpoint) as backend:
        with pytest.raises(PermissionDeniedError, match="GOOGLE_APPLICATION_CREDENTIALS"):
            await backend.write("k", b"x")


@pytest.mark.parametrize("emulator", [True, False])
async def test_create_checks_first_only_on_an_emulator(
    ckptstore_gcs_server: FakeGcsServer, ckptstore_gcs_bucket: str, emulator: bool
) -> None:
    """Off emulator mode the precondition alone decides (no check-then-write window)."""
    async with make(ckptstore_gcs_server, ckptstore_gcs_bucket, emulator=emulator) as b:
        methods: list[str] = []
        real_request = b._request

        async def spy(op: str, key: str | None, method: str, url: str, **kw: Any) -> Any:
            methods.append(method)
            return await real_request(op, key, method, url, **kw)

        b._request = spy  # type: ignore[method-assign]
        await b.create("marker", b"1")
        assert methods == (["GET", "POST"] if emulator else ["POST"])


def test_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    b = GcsBackend("b", credentials="anonymous")
    assert b.endpoint_url == "http://localhost:4443" and b.emulated
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    assert GcsBackend("b", credentials="anonymous").endpoint_url is None


def test_invalid_options(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="service-account"):
        GcsBackend("b", credentials="/no/such/file.json")
    with pytest.raises(ConfigError):
        GcsBackend("b", chunk_size=1000)
    with pytest.raises(ConfigError):
        GcsBackend("a/b")


# ---- uploads ------------------------------------------------------------------------------


async def test_resumable_upload(
    ckptstore_gcs_server: FakeGcsServer, ckptstore_gcs_bucket: str
) -> None:
    async with make(
        ckptstore_gcs_server, ckptstore_gcs_bucket, resumable_threshold=MiB, chunk_size=256 * 1024
    ) as b:
        data = os.urandom(MiB + 12345)  # 5 chunks, the last one short
        await b.write("big", data)
        assert await b.read("big") == data
        assert (await b.stat("big")).size == len(data)
        await b.create("big-marker", data)
        with pytest.raises(AlreadyExistsError):
            await b.create("big-marker", b"x" * (2 * MiB))


async def test_create_sends_generation_precondition(gcs: GcsBackend) -> None:
    """The precondition goes to the server even where the emulator fallback also checks."""
    seen: list[dict[str, str]] = []
    real_request = gcs._request

    async def spy(op: str, key: str | None, method: str, url: str, **kw: Any) -> Any:
        if method == "POST":
            seen.append(dict(kw.get("params") or {}))
        return await real_request(op, key, method, url, **kw)

    gcs._request = spy  # type: ignore[method-assign]
    await gcs.create("marker", b"1")
    assert seen == [{"name": "root/dir/marker", "ifGenerationMatch": "0", "uploadType": "media"}]


async def test_server_412_is_already_exists(gcs: GcsBackend) -> None:
    """Real GCS answers 412 to ifGenerationMatch=0 on an existing object (simulated here)."""
    gcs.emulated = False  # skip the emulator's check-first fallback
    real_request = gcs._request

    async def precondition_failed(
        op: str, key: str | None, method: str, url: str, **kw: Any
    ) -> Any:
        if method == "POST" and "ifGenerationMatch" in (kw.get("params") or {}):
            assert 412 in kw["ok_statuses"]
            return 412, {}, b'{"error": {"code": 412, "message": "conditionNotMet"}}'
        return await real_request(op, key, method, url, **kw)

    gcs._request = precondition_failed  # type: ignore[method-assign]
    with pytest.raises(AlreadyExistsError):
        await gcs.create("marker", b"1")


# ---- errors -------------------------------------------------------------------------------


async def test_missing_bucket_is_not_found(ckptstore_gcs_server: FakeGcsServer) -> None:
    async with make(ckptstore_gcs_server, "no-such-bucket-here", retry=NO_RETRY) as b:
        with pytest.raises(NotFoundError) as info:
            await b.read("k")
        assert "gs://no-such-bucket-here" in str(info.value)
        with pytest.raises(NotFoundError):
            [i async for i in b.list()]


async def test_unreachable_endpoint_is_transient() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    b = GcsBackend(
        "bkt", endpoint_url=f"http://127.0.0.1:{port}", retry=NO_RETRY, credentials="anonymous"
    )
    with pytest.raises(TransientStorageError) as info:
        await b.read("k")
    assert "'k'" in str(info.value)
    await b.close()


def test_statuses_map_to_typed_errors() -> None:
    url = "gs://bkt/p"
    cases = {
        404: NotFoundError,
        403: PermissionDeniedError,
        401: PermissionDeniedError,
        429: TransientStorageError,
        503: TransientStorageError,
        400: StorageError,
    }
    for status, kind in cases.items():
        err = error_for(op="read", backend=url, key="k", status=status, detail="msg")
        assert type(err) is kind, status
        assert url in str(err) and "'k'" in str(err) and "msg" in str(err)


def test_secret_file_never_shown(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    secret = "-----BEGIN PRIVATE KEY-----TOPSECRET"
    path = tmp_path / "sa.json"
    path.write_text(json.dumps({"type": "service_account", "private_key": secret}))
    b = GcsBackend("bkt", credentials=str(path))
    assert "TOPSECRET" not in repr(b) and "credentials=file" in repr(b)
    assert "TOPSECRET" not in json.dumps(b.kvstore_spec())


async def test_bad_service_account_file_is_clean_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading fails before any request, and the error quotes nothing from the file."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    path = tmp_path / "sa.json"
    path.write_text('{"type": "service_account", "private_key": "TOPSECRET"}')
    b = GcsBackend("bkt", credentials=str(path), retry=NO_RETRY)
    assert not b.emulated
    with pytest.raises(PermissionDeniedError) as info:
        await b.read("k")
    assert "TOPSECRET" not in str(info.value)
    assert "TOPSECRET" not in repr(info.value.__cause__)


# ---- TensorStore ------------------------------------------------------------------------------


def test_kvstore_spec_requires_matching_tensorstore_endpoint(
    ckptstore_gcs_server: FakeGcsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = GcsBackend("bkt", "p", endpoint_url=ckptstore_gcs_server.endpoint, credentials="anonymous")
    assert b.kvstore_spec("x") == {"driver": "gcs", "bucket": "bkt", "path": "p/x/"}
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
    with pytest.raises(ConfigError, match="TENSORSTORE_GCS_HTTP_URL"):
        b.kvstore_spec("x")


async def test_zarr3_over_ocdbt_roundtrip(gcs: GcsBackend) -> None:
    data = np.arange(32 * 48, dtype=np.int32).reshape(32, 48)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": gcs.kvstore_spec("ckpt/state")},
    }
    arr = await ts.open(spec, create=True, dtype=ts.int32, shape=data.shape, context=gcs.ts_context)
    await arr.write(data)
    keys = [i.key async for i in gcs.list("ckpt/state")]
    assert "ckpt/state/manifest.ocdbt" in keys
    reopened = await ts.open(spec, context=gcs.ts_context)
    np.testing.assert_array_equal(await reopened.read(), data)
