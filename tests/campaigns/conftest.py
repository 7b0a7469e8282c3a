"""Fixtures of the campaigns: moto's S3 server and fake-gcs-server behind a `FaultProxy`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ckptstore.backends.base import Backend
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.s3 import S3Backend
from ckptstore.testing.faultproxy import FaultProxy
from tests.campaigns.proxied import POLICY, Make


@pytest.fixture(params=["s3", "gcs"])
def behind_proxy(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FaultProxy, Make]]:
    """A proxy in front of the emulator, and a maker of backends (and TensorStore) using it."""
    kind = request.param
    server = request.getfixturevalue(
        "ckptstore_s3_server" if kind == "s3" else "ckptstore_gcs_server"
    )
    bucket = request.getfixturevalue(
        "ckptstore_s3_bucket" if kind == "s3" else "ckptstore_gcs_bucket"
    )
    with FaultProxy(server.endpoint) as proxy:

        def make(**kw: Any) -> Backend:
            kw.setdefault("retry", POLICY)
            if kind == "s3":
                return S3Backend(
                    bucket, "run", endpoint_url=proxy.endpoint, credentials="env", **kw
                )
            return GcsBackend(
                bucket,
                "run",
                endpoint_url=proxy.endpoint,
                credentials="anonymous",
                emulator=True,
                **kw,
            )

        if kind == "gcs":  # TensorStore reads its GCS endpoint from the environment
            monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.endpoint)
        yield proxy, make
