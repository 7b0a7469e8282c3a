"""Planted secrets never come back: not in an error's text, repr or traceback, not on the
command line's stdout or stderr, not in any log record (every logger at DEBUG).

The sweep plants a password in endpoint URLs (malformed ones the SDKs would quote whole,
well-formed ones carrying ``user:password@``) under every name an endpoint comes by
(option, profile, ``--endpoint``, each environment variable), and signed query strings and
userinfo in target URLs. Each must be refused typed, before any SDK sees it, naming the
field. One more case reaches a (dead) server with a secret key in the environment.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.s3 import S3Backend
from ckptstore.cli import main as cli
from ckptstore.errors import storage_failed

SECRET = "Pl4nted-s3cr3t"

#: Endpoint values that carry SECRET: id -> value.
ENDPOINTS: dict[str, str] = {
    "no scheme": f"u:{SECRET}@host:9000",
    "scheme without colon": f"http//u:{SECRET}@host:9000",
    "userinfo": f"http://u:{SECRET}@127.0.0.1:9",
    "password with a slash": f"http://u:a/{SECRET}@127.0.0.1:9",
    "password with an @": f"http://u:{SECRET}@x@127.0.0.1:9",
    "wrong scheme": f"ftp://u:{SECRET}@127.0.0.1:9",
    "signed query": f"http://127.0.0.1:9/?X-Amz-Signature={SECRET}",
    "any query": f"http://127.0.0.1:9/?pw={SECRET}",
    "fragment": f"http://127.0.0.1:9/#{SECRET}",
    "bad port": f"http://127.0.0.1:{SECRET}",
}

#: Where an endpoint comes from: id -> (the name the error must give, how to open with it).
Opener = Callable[[str, pytest.MonkeyPatch, Path], Any]


def _profile(url: str, endpoint: str, tmp: Path) -> Path:
    file = tmp / "p.toml"
    file.write_text(
        f'url = "{url}"\n[options]\nendpoint = "{endpoint}"\ncredentials = "anonymous"\n'
    )
    return file


SOURCES: dict[str, tuple[str, Opener]] = {
    "S3 option": (
        "option 'endpoint'",
        lambda e, _m, _t: ckptstore.open_backend("s3://b/p", endpoint=e, credentials="anonymous"),
    ),
    "S3 constructor": (
        "option 'endpoint'",
        lambda e, _m, _t: S3Backend("b", "p", endpoint_url=e, credentials="anonymous"),
    ),
    "S3 profile": (
        "option 'endpoint'",
        lambda e, _m, t: ckptstore.open_backend(profile=_profile("s3://b/p", e, t)),
    ),
    "AWS_ENDPOINT_URL_S3": (
        "$AWS_ENDPOINT_URL_S3",
        lambda e, m, _t: (
            m.setenv("AWS_ENDPOINT_URL_S3", e),
            ckptstore.open_backend("s3://b/p", credentials="anonymous"),
        ),
    ),
    "AWS_ENDPOINT_URL": (
        "$AWS_ENDPOINT_URL",
        lambda e, m, _t: (
            m.setenv("AWS_ENDPOINT_URL", e),
            ckptstore.open_backend("s3://b/p", credentials="anonymous"),
        ),
    ),
    "GCS option": (
        "option 'endpoint'",
        lambda e, _m, _t: ckptstore.open_backend("gs://b/p", endpoint=e, credentials="anonymous"),
    ),
    "GCS profile": (
        "option 'endpoint'",
        lambda e, _m, t: ckptstore.open_backend(profile=_profile("gs://b/p", e, t)),
    ),
    "STORAGE_EMULATOR_HOST": (
        "$STORAGE_EMULATOR_HOST",
        lambda e, m, _t: (
            m.setenv("STORAGE_EMULATOR_HOST", e),
            ckptstore.open_backend("gs://b/p", credentials="anonymous"),
        ),
    ),
    "TENSORSTORE_GCS_HTTP_URL": (
        "$TENSORSTORE_GCS_HTTP_URL",
        lambda e, m, _t: (
            m.setenv("TENSORSTORE_GCS_HTTP_URL", e),
            GcsBackend(
                "b", "p", endpoint_url="http://127.0.0.1:9", credentials="anonymous"
            ).kvstore_spec(),
        ),
    ),
}

#: Target URLs that carry SECRET: id -> URL.
TARGETS: dict[str, str] = {
    "signed S3 URL": f"s3://b/x?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIA{SECRET}",
    "GCS token": f"gs://b/x?access_token={SECRET}",
    "any query": f"s3://b/x?pw={SECRET}",
    "fragment": f"s3://b/x#{SECRET}",
    "userinfo": f"s3://AKIA:{SECRET}@b/x",
    "userinfo with a slash": f"s3://AKIA:a/{SECRET}@b/x",
    "unknown scheme": f"https://u:{SECRET}@host/x?sig={SECRET}",
    "memory query": f"memory://m?token={SECRET}",
    "file URL with userinfo": f"file://u:{SECRET}@host/x",
}


@pytest.fixture
def every_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every logger at DEBUG, every record captured (non-propagating loggers included)."""
    saved: list[tuple[logging.Logger, int, bool]] = []
    for logger in [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
        saved.append((logger, logger.level, logger.propagate))
        logger.setLevel(logging.DEBUG)
        if not logger.propagate:
            logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    try:
        yield caplog
    finally:
        for logger, level, _ in saved:
            logger.setLevel(level)
            logger.removeHandler(caplog.handler)


def texts(exc: BaseException) -> list[str]:
    """What an error can show: its text, its repr, its traceback with every cause."""
    return [str(exc), repr(exc), "".join(traceback.format_exception(exc))]


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return [formatter.format(r) for r in caplog.records]


def found(outputs: list[str]) -> list[str]:
    return [text for text in outputs if SECRET in text]


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_an_endpoint_carrying_a_secret_is_refused_unechoed(
    endpoint: str,
    source: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    every_log: pytest.LogCaptureFixture,
) -> None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    field, opener = SOURCES[source]
    with pytest.raises(ckptstore.ConfigError) as info:
        opener(ENDPOINTS[endpoint], monkeypatch, tmp_path)
    assert field in str(info.value)
    assert found([*texts(info.value), *logged(every_log)]) == []


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_cli_endpoint_carrying_a_secret_is_refused_unechoed(
    endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    every_log: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    for url in ("s3://b/p", "gs://b/p"):
        assert cli(["--endpoint", ENDPOINTS[endpoint], "ls", url]) == 2
        out = capsys.readouterr()
        assert "option 'endpoint'" in out.err
        assert found([out.out, out.err, *logged(every_log)]) == []


def _sweep_target(url: str) -> list[str]:
    """Every API operation and CLI command on ``url``: each refused typed; their texts."""
    operations: list[Callable[[], Any]] = [
        lambda: ckptstore.open_backend(url),
        lambda: ckptstore.list_steps_sync(url),
        lambda: ckptstore.save_sync(url, {"x": np.arange(3)}, step=1),
        lambda: ckptstore.restore_sync(url),
        lambda: ckptstore.verify_sync(url),
        lambda: asyncio.run(ckptstore.gc(url, older_than=0)),
        lambda: asyncio.run(ckptstore.delete_step(url, 1)),
    ]
    shown: list[str] = []
    for operation in operations:
        try:
            result = operation()
        except ckptstore.InvalidURLError as exc:
            shown += texts(exc)
        else:
            shown.append(repr(result))
            with pytest.raises(ckptstore.InvalidURLError) as info:
                ckptstore.list_steps_sync(result)
            shown += texts(info.value)
    return shown


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_target_url_carrying_a_secret_is_refused_unechoed(
    target: str,
    capsys: pytest.CaptureFixture[str],
    every_log: pytest.LogCaptureFixture,
) -> None:
    url = TARGETS[target]
    shown = _sweep_target(url)
    for command in (["ls"], ["info"], ["verify"], ["rm", "--step", "1"], ["gc"]):
        assert cli([*command, url]) == 2
        out = capsys.readouterr()
        shown += [out.out, out.err]
    assert found([*shown, *logged(every_log)]) == []


def test_a_tiered_target_does_not_show_a_signed_url(tmp_path: Path) -> None:
    tiers = ckptstore.Tiered(str(tmp_path / "fast"), TARGETS["signed S3 URL"])
    assert found([repr(tiers)]) == []


def test_a_secret_key_and_token_reaching_a_dead_server_are_not_logged(
    monkeypatch: pytest.MonkeyPatch, every_log: pytest.LogCaptureFixture
) -> None:
    """A well-formed endpoint that refuses connections, with the secret access key and a
    session token in the environment: the listing fails typed, and neither it nor the SDK's
    DEBUG lines (botocore logs each request's headers and the canonical request it signs)
    carry either."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", f"token-{SECRET}")
    backend = ckptstore.open_backend(
        "s3://b/p", endpoint=f"http://127.0.0.1:{port}", credentials="env", retry=1
    )

    async def listing() -> None:
        try:
            await ckptstore.list_steps(backend)
        finally:
            await backend.close()

    with pytest.raises(ckptstore.StorageError) as info:
        asyncio.run(listing())
    assert storage_failed(info.value)
    assert any(r.name.startswith("botocore") for r in every_log.records)  # it logged
    assert found([*texts(info.value), repr(backend), *logged(every_log)]) == []
