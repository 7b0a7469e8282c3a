"""TensorStore's failures as ckptstore's typed errors.

TensorStore raises `ValueError` for nearly everything, its absl status code leading
the text ("UNAVAILABLE: ...", "PERMISSION_DENIED: ..."). Its s3/gcs drivers map HTTP
statuses and curl failures onto those codes and retry transient ones themselves,
under the `RetryPolicy` of the backend (`retry_resource`), ending with "All N retry
attempts failed". So the code tells a failure of the *storage* (permission, an
unreachable or overloaded server, a timeout, retries used up) from a failure of the
*data* (bad bytes, a missing file): `storage_error` types the first kind and leaves
the second to the caller, who knows whether it means a corrupt checkpoint
(`ckptstore.datapath.reads.read_error` builds on it) or a failed write
(`write_error`). Texts are redacted (`redact_text`) and trimmed: a URL's password or a
signed query never reaches a message.
"""

from __future__ import annotations

import re
from typing import Any

from ckptstore.backends._errors import redact_text
from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import (
    CkptStoreError,
    InsufficientSpaceError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
)

#: Characters of TensorStore's text kept in a message.
MAX_TEXT = 400

_CODE = re.compile(r"^([A-Z][A-Z_]+): ")
_EXHAUSTED = re.compile(r"All \d+ retry attempts failed")
#: The operating system's words for a full disk or quota (TensorStore reports a full disk
#: as RESOURCE_EXHAUSTED, its code for throttling too: but this one no retry can fix).
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded")
_KINDS: dict[str, type[StorageError]] = {
    "PERMISSION_DENIED": PermissionDeniedError,
    "UNAUTHENTICATED": PermissionDeniedError,
    "UNAVAILABLE": TransientStorageError,
    "DEADLINE_EXCEEDED": TransientStorageError,
    "RESOURCE_EXHAUSTED": TransientStorageError,
    "ABORTED": TransientStorageError,  # 409 Conflict, or the retries ran out (below)
}
#: Payloads TensorStore appends ("[source locations='...']", the reply's body, ...).
_NOISE = re.compile(
    r"\s*\[(?:source locations|tensorstore_spec|http_response_body)=.*?\](?=\s*(?:\[|$))", re.S
)


def status_code(exc: BaseException) -> str | None:
    """The absl status code TensorStore put at the head of ``exc``'s text, if any."""
    match = _CODE.match(str(exc))
    return match.group(1) if match else None


def message(exc: BaseException) -> str:
    """``exc``'s text, redacted, without TensorStore's source locations, trimmed."""
    text = redact_text(_NOISE.sub("", str(exc)).strip())
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def storage_error(exc: BaseException, *, op: str) -> StorageError | None:
    """The typed error for a failure of the storage itself; None for anything else.

    Out of space or quota: `InsufficientSpaceError`. Permission refused:
    `PermissionDeniedError`. Unavailable, timed out, throttled:
    `TransientStorageError` (TensorStore already retried it under the backend's policy;
    `RetriesExhaustedError` when it says so).
    """
    if isinstance(exc, StorageError):
        return exc
    full = _NO_SPACE.search(str(exc))
    if full is not None:  # the reason first: TensorStore's long text is trimmed
        return InsufficientSpaceError(
            f"{op} failed: {full.group(0)}, the storage is full: {message(exc)}"
        )
    code = status_code(exc)
    kind = _KINDS.get(code or "")
    if kind is None:
        return None
    text = f"{op} failed: {message(exc)}"
    if kind is TransientStorageError and _EXHAUSTED.search(str(exc)):
        kind = RetriesExhaustedError
    return kind(text)


def write_error(exc: BaseException, what: str) -> CkptStoreError:
    """A failed write through TensorStore, typed (a missing bucket is `NotFoundError`)."""
    if isinstance(exc, CkptStoreError):
        return exc
    typed = storage_error(exc, op=f"writing {what}")
    if typed is not None:
        return typed
    kind = NotFoundError if status_code(exc) == "NOT_FOUND" else StorageError
    return kind(f"writing {what} failed: {message(exc)}")


def retry_resource(policy: RetryPolicy) -> dict[str, Any]:
    """TensorStore's ``<driver>_request_retries`` context resource for ``policy``.

    TensorStore counts retries after the first try (at least 1) and backs off from
    ``initial_delay`` doubling up to ``max_delay``, as `RetryPolicy` does, so one policy
    governs a request whoever sends it.
    """
    return {
        "max_retries": max(1, policy.max_attempts - 1),
        "initial_delay": f"{policy.base_delay:.6f}s",
        "max_delay": f"{max(policy.max_delay, policy.base_delay):.6f}s",
    }
