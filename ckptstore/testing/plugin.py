"""pytest plugin: S3 and GCS emulators for any test suite (registered as ``ckptstore``).

Installing ``ckptstore[testing]`` registers this plugin through the ``pytest11`` entry
point, so these fixtures are available without any ``conftest.py``. Their names all start
with ``ckptstore_``, so they do not collide with a project's own ``s3_bucket`` or another
plugin's ``moto_server``:

- ``ckptstore_s3_server`` (session): a `MotoS3Server` on 127.0.0.1. For the session it
  sets ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` to ``testing``, ``AWS_REGION`` /
  ``AWS_DEFAULT_REGION`` to ``us-east-1``, points ``AWS_CONFIG_FILE`` and
  ``AWS_SHARED_CREDENTIALS_FILE`` at empty files (your own AWS configuration stays out),
  disables the EC2 metadata service and unsets ``AWS_PROFILE``, ``AWS_SESSION_TOKEN`` and
  any ``AWS_ENDPOINT_URL(_S3)`` of your own.
- ``ckptstore_gcs_server`` (session): a `FakeGcsServer`. Sets ``STORAGE_EMULATOR_HOST``
  (gcsfs, google-cloud-storage) and ``TENSORSTORE_GCS_HTTP_URL`` (TensorStore) to its
  endpoint.
- ``ckptstore_s3_bucket`` / ``ckptstore_gcs_bucket`` (function): a freshly created, empty
  bucket on the corresponding server, unique per test. ``ckptstore_s3_bucket`` also sets
  ``AWS_ENDPOINT_URL_S3`` to the moto server for that test, so plain
  ``s3://{ckptstore_s3_bucket}/...`` URLs reach it (as ``gs://{ckptstore_gcs_bucket}/...``
  URLs reach fake-gcs-server).

Every variable is restored afterwards (at the end of the test or of the session). Servers
start lazily, only in sessions that request them. Example, with no configuration at all::

    import numpy as np
    import pytest
    import ckptstore

    @pytest.fixture
    async def backend(ckptstore_s3_bucket):
        async with ckptstore.open_backend(f"s3://{ckptstore_s3_bucket}/run") as b:
            yield b

    async def test_roundtrip(backend):
        await ckptstore.save(backend, {"w": np.arange(4)}, step=1)
        assert await ckptstore.list_steps(backend) == [1]

Async tests and fixtures: under pytest-asyncio's default (strict) mode, this plugin runs
coroutine tests and async fixtures that no other async plugin claimed (no ``asyncio``,
``anyio`` or ``trio`` marker, no ``anyio_backend``) on asyncio, so no ``asyncio_mode``
setting is needed, and pytest-asyncio's ``asyncio_default_fixture_loop_scope`` defaults to
``function`` unless set (no warning about it). Turn that off with ``ckptstore_asyncio =
false`` in the pytest ini.

Importing this module imports neither JAX nor TensorStore (a ``conftest.py`` may still set
``JAX_PLATFORMS``), and sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` unless already set:
gcsfs reads it at import time, and its experimental mode stalls ~60 s per operation against
an emulator. fake-gcs-server does not enforce preconditions, so create-if-absent races are
not decided by the server there.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from ckptstore.testing.servers import MOTO_KEY, MOTO_REGION, FakeGcsServer, MotoS3Server

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_ASYNC_MARKS = ("asyncio", "anyio", "trio")
_claimed: set[Any] = set()  # async fixture functions handed to pytest-asyncio


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "ckptstore_asyncio",
        type="bool",
        default=True,
        help="ckptstore: run unclaimed coroutine tests and async fixtures on asyncio "
        "under pytest-asyncio's strict mode",
    )


def _claims_async(config: pytest.Config) -> bool:
    """Whether unclaimed async tests and fixtures are ours to hand to pytest-asyncio."""
    if not config.getini("ckptstore_asyncio") or not config.pluginmanager.hasplugin("asyncio"):
        return False
    mode = config.getoption("asyncio_mode", None) or config.getini("asyncio_mode")
    return bool(mode == "strict")  # in auto mode pytest-asyncio takes them anyway


#: pytest-asyncio's ini option, which it warns about when unset (its default is to change).
_LOOP_SCOPE = "asyncio_default_fixture_loop_scope"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Where this plugin runs async tests for the project (`_claims_async`) and the
    project did not choose pytest-asyncio's fixture loop scope: "function", the default
    pytest-asyncio recommends, so that it does not warn about a setting nobody made.
    (Runs before pytest-asyncio's own ``pytest_configure`` reads it.)"""
    if not _claims_async(config):
        return
    try:
        unset = config.getini(_LOOP_SCOPE) is None
    except ValueError:  # an older pytest-asyncio without the option
        return
    if unset:
        config._inicache[_LOOP_SCOPE] = "function"  # pytest has no public setter for ini values


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, Any, Any]:
    """Mark an unmarked coroutine test ``asyncio`` before pytest-asyncio looks at it."""
    if (
        inspect.iscoroutinefunction(obj)
        and collector.istestfunction(obj, name)
        and _claims_async(collector.config)
        and not any(m.name in _ASYNC_MARKS for m in getattr(obj, "pytestmark", []))
        and not any(collector.get_closest_marker(m) for m in _ASYNC_MARKS)
    ):
        pytest.mark.asyncio(obj)
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    """Hand an unclaimed async fixture to pytest-asyncio, as its own decorator would."""
    func = fixturedef.func
    if (
        func not in _claimed
        and (inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func))
        and "anyio_backend" not in fixturedef.argnames
        and not any(request.node.get_closest_marker(m) for m in ("anyio", "trio"))
        and _claims_async(request.config)
    ):
        import pytest_asyncio

        if not getattr(func, "_force_asyncio_fixture", False):  # not decorated already
            pytest_asyncio.fixture(func)  # marks ``func`` itself; the wrapper is not needed
        _claimed.add(func)
    return (yield)


@pytest.fixture(scope="session")
def ckptstore_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3Server]:
    """moto's S3 server for the session, with the AWS environment pointed at test credentials."""
    empty = tmp_path_factory.mktemp("aws") / "empty"
    empty.write_text("")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", MOTO_KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", MOTO_KEY)
        env.setenv("AWS_REGION", MOTO_REGION)
        env.setenv("AWS_DEFAULT_REGION", MOTO_REGION)
        env.setenv("AWS_CONFIG_FILE", str(empty))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        with MotoS3Server() as server:
            yield server


@pytest.fixture(scope="session")
def ckptstore_gcs_server() -> Iterator[FakeGcsServer]:
    """fake-gcs-server for the session, with gcsfs and TensorStore pointed at it."""
    with FakeGcsServer() as server, pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        env.setenv("TENSORSTORE_GCS_HTTP_URL", server.endpoint)
        yield server


@pytest.fixture
def ckptstore_s3_bucket(ckptstore_s3_server: MotoS3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new, empty bucket on the moto server; plain ``s3://`` URLs reach it in this test."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", ckptstore_s3_server.endpoint)
    return ckptstore_s3_server.create_bucket()


@pytest.fixture
def ckptstore_gcs_bucket(ckptstore_gcs_server: FakeGcsServer) -> str:
    """A new, empty bucket on fake-gcs-server."""
    return ckptstore_gcs_server.create_bucket()
