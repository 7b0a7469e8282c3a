"""A save to a bucket that does not exist fails with a typed error that names the bucket,
and logs no clean-up of an attempt that never existed."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import NotFoundError
from ckptstore.testing.servers import FakeGcsServer, MotoS3Server


@pytest.mark.parametrize("scheme", ["s3", "gs"])
async def test_a_save_to_a_missing_bucket_says_so(
    scheme: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server: MotoS3Server | FakeGcsServer = request.getfixturevalue(
        "ckptstore_s3_server" if scheme == "s3" else "ckptstore_gcs_server"
    )
    if scheme == "s3":
        request.getfixturevalue("ckptstore_s3_bucket")  # points plain s3:// URLs at moto
    url = f"{scheme}://no-such-bucket-27/run"
    tree = {"w": np.arange(1 << 16, dtype=np.float32), "b": np.ones(3)}
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        with pytest.raises(NotFoundError) as raised:
            await ckptstore.save(url, tree, step=1)
    message = str(raised.value)
    assert f"bucket 'no-such-bucket-27' does not exist at {server.endpoint}" in message
    assert "nothing was saved" in message
    assert "attempt" not in caplog.text  # no "left attempt ... for gc": there is none
