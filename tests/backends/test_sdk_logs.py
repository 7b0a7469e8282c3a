"""The AWS C SDK's error lines (printed through TensorStore's s3 driver for every credential
source it skips) stay off stderr unless asked for; other stderr output is untouched."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore.backends.sdklog import is_aws_line, quiet_aws_sdk
from tests.backends.helpers import clean_env

AWS_LINE = (
    b"E1201 05:08:52.124881   31545 common-io:5] static: Failed to open file. "
    b"path:'/root/.aws/config' mode:'rb' errno:2\n"
)
TS_LINE = b"W1201 05:08:52.124881   31545 s3_key_value_store.cc:120] something TensorStore says\n"

SCRIPT = """
import logging
import logging
import os
import sys

import numpy as np

import ckptstore
from ckptstore.testing.servers import MotoS3Server

with MotoS3Server() as server:
    os.environ.update(
        AWS_ENDPOINT_URL_S3=server.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
    )
    url = f"s3://{server.create_bucket()}/run"
    ckptstore.save_sync(url, {"w": np.arange(4)}, step=1)
    assert ckptstore.restore_sync(url)["w"].tolist() == [0, 1, 2, 3]
    print("== debug logging", file=sys.stderr, flush=True)
    handler = logging.StreamHandler(sys.stdout)
    logging.getLogger("ckptstore.aws").addHandler(handler)
    logging.getLogger("ckptstore.aws").setLevel(logging.DEBUG)
    ckptstore.restore_sync(url)
    print("== asked", file=sys.stderr, flush=True)
    os.environ["CKPTSTORE_AWS_LOGS"] = "1"
    ckptstore.restore_sync(url)
"""


def test_sdk_lines_stay_off_stderr_unless_asked(tmp_path: Path) -> None:
    """No ~/.aws at all (HOME is an empty folder): the SDK's chain complains about every
    file it looks for, in every process, though the environment's keys work."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**clean_env(), "HOME": str(home), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    quiet, rest = proc.stderr.split("== debug logging\n")
    debug, asked = rest.split("== asked\n")
    assert "Failed to open file" not in quiet + debug, quiet + debug
    assert not [line for line in (quiet + debug).splitlines() if is_aws_line(line.encode())]
    missing = f"Failed to open file. path:'{home}/.aws/config'"
    assert missing in proc.stdout  # at DEBUG, to the logger "ckptstore.aws"
    assert missing in asked  # CKPTSTORE_AWS_LOGS=1: as the SDK prints them


def test_only_the_sdk_lines_are_held_back(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTSTORE_AWS_LOGS", raising=False)
    monkeypatch.delenv("TENSORSTORE_VERBOSE_LOGGING", raising=False)
    with quiet_aws_sdk():
        os.write(2, b"before\n" + AWS_LINE + TS_LINE)
        os.write(2, b"more\n")
        os.write(2, AWS_LINE + b"after\n")
    err = capfd.readouterr().err
    assert err == "before\n" + TS_LINE.decode() + "more\nafter\n"
    assert is_aws_line(AWS_LINE) and not is_aws_line(TS_LINE)
    monkeypatch.setenv("TENSORSTORE_VERBOSE_LOGGING", "aws=1")
    with quiet_aws_sdk():
        os.write(2, AWS_LINE)
    assert capfd.readouterr().err == AWS_LINE.decode()


def test_botocore_debug_records_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """The forms botocore logs at DEBUG: a request's headers, the canonical request it
    signs, an STS reply. (tests/campaigns/test_secrets.py checks the same against a real client.)"""
    import ckptstore.backends.s3  # noqa: F401 - installs the filter

    lines = {
        "botocore.endpoint": "Sending http request: <AWSPreparedRequest headers={"
        "'X-Amz-Security-Token': b'TOK1', 'Authorization': b'AWS4-HMAC-SHA256 "
        "Credential=AKIA/x, SignedHeaders=host, Signature=SIG2'}>",
        "botocore.auth": "CanonicalRequest:\nGET\n/\n\nx-amz-security-token:TOK3\n",
        "botocore.parsers": "Response body:\nb'<SecretAccessKey>KEY4</SecretAccessKey>"
        "<SessionToken>TOK5</SessionToken>'",
    }
    caplog.set_level("DEBUG")
    for name, line in lines.items():
        logging.getLogger(name).debug("%s", line)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 3
    for secret in ("TOK1", "SIG2", "TOK3", "KEY4", "TOK5"):
        assert secret not in text, text
