"""moto's in-process ``mock_aws()`` cannot serve ckptstore's S3 clients: an S3 target says so,
typed, naming what works instead (docs/testing.md), rather than failing deep inside
aiobotocore; once the mock is gone, S3 targets open as usual."""

from __future__ import annotations

import moto
import numpy as np
import pytest

import ckptstore
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import ConfigError


def test_an_s3_target_under_mock_aws_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        with pytest.raises(ConfigError, match=r"mock_aws\(\).*ckptstore_s3_bucket.*Threaded"):
            ckptstore.save_sync("s3://bucket/run", {"x": np.arange(4)}, step=1)
        with pytest.raises(ConfigError, match="mock_aws"):
            S3Backend("bucket", "run", credentials="env")
    S3Backend("bucket", "run", credentials="env")  # the mock is gone: no error
