"""Keeping the AWS C SDK's log lines off stderr unless asked for.

TensorStore's ``s3`` driver builds its AWS credential provider chain (environment, shared
files, web identity, ECS, instance metadata) when a context first uses it, and the AWS
libraries log every source they could not use at *error* level through TensorStore's
logging, straight to the process's stderr: ``E... common-io:5] static: Failed to open
file. path:'~/.aws/config'`` and the like, several lines per backend, in every process,
for configurations that work. TensorStore offers no setting to lower that level.

`quiet_aws_sdk` captures file descriptor 2 around the call that builds the chain and
writes back everything except those lines; they go to the ``ckptstore.aws`` logger at
DEBUG instead. Set ``CKPTSTORE_AWS_LOGS=1`` (or ask TensorStore for them with
``TENSORSTORE_VERBOSE_LOGGING=aws``) to see them on stderr as the SDK prints them.

`redact_sdk_logs` masks credentials in botocore's own DEBUG records: each request's headers
(``X-Amz-Security-Token``, ``Authorization``), the canonical request it signs, and response
bodies (an STS reply's ``SecretAccessKey``), whichever handler the application attaches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

from ckptstore.backends._errors import redact_text

SHOW_ENV = "CKPTSTORE_AWS_LOGS"
log = logging.getLogger("ckptstore.aws")

#: A TensorStore log line from the AWS bridge: absl's prefix, then the AWS log subject
#: where a source file name would be (``common-io:5]``; TensorStore's own lines name a
#: ``.cc`` file there).
_AWS_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [A-Za-z][\w-]*:\d+\] ")
_lock = threading.Lock()


#: botocore's loggers whose DEBUG records quote credentials (a filter on a logger sees only
#: the records logged through that very logger, so each is named).
SDK_LOGGERS = (
    "botocore.auth",
    "botocore.endpoint",
    "botocore.parsers",
    "botocore.hooks",
    "botocore.httpsession",
    "aiobotocore.endpoint",
    "aiobotocore.httpsession",
)


class _Redact(logging.Filter):
    """Replaces a record's message by its redacted text (`redact_text`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging report it as it would
            return True
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACT = _Redact()


def redact_sdk_logs() -> None:
    """Install the redacting filter on `SDK_LOGGERS` (idempotent)."""
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


def wanted() -> bool:
    """Whether the user asked to see the SDK's lines on stderr."""
    if os.environ.get(SHOW_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return True
    return "aws" in os.environ.get("TENSORSTORE_VERBOSE_LOGGING", "")


def is_aws_line(line: bytes) -> bool:
    """Whether ``line`` is one the AWS libraries logged through TensorStore."""
    return _AWS_LINE.match(line) is not None


@contextlib.contextmanager
def quiet_aws_sdk() -> Iterator[None]:
    """Hold back the AWS SDK's lines written to stderr (fd 2) inside the block.

    Everything else written to stderr meanwhile, by any thread, is written back when the
    block ends, in order. Meant for short, synchronous calls (building a TensorStore
    context's credentials); nested or concurrent uses wait for each other.
    """
    if wanted():
        yield
        return
    with _lock:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to protect
            yield
            return
        with tempfile.TemporaryFile() as capture:
            os.dup2(capture.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                capture.seek(0)
                _replay(capture.read())


def _replay(captured: bytes) -> None:
    """Write back the captured lines that are not the SDK's; log those at DEBUG."""
    kept = []
    for line in captured.splitlines(keepends=True):
        if is_aws_line(line):
            log.debug("%s", line.decode(errors="replace").rstrip())
        else:
            kept.append(line)
    rest = memoryview(b"".join(kept))
    while rest:
        rest = rest[os.write(2, rest) :]
