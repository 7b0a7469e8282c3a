"""Mapping cloud-client failures onto ckptstore's typed errors (shared by S3 and GCS).

Both object stores answer with an HTTP status plus, sometimes, a service error
code; both clients raise transport exceptions (resets, timeouts) of their own.
One table decides what is "not found", "permission", "transient" or plain
failure, so the two backends cannot drift apart. `gather_first_error` is the
shared "fail fast" for their concurrent part uploads and deletes.
"""

from __future__ import annotations

import asyncio
import re

from ckptstore.errors import (
    AlreadyExistsError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)

#: Service error codes (S3's; GCS answers with statuses only) by meaning.
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"})
PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "Forbidden",
        "403",
    }
)
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        # A concurrent conditional write is in flight on the key: AWS says "try again".
        # A retry then either wins or sees the winner's PreconditionFailed.
        "ConditionalRequestConflict",
    }
)
TRANSIENT_STATUSES = frozenset({408, 429})


def transport_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of the HTTP stack that mean "the request may not have happened": retry.

    A function, called by the object-store backends when they load, so that a save to
    local disk never imports aiohttp (a third of a second of a process's first save).
    """
    client: tuple[type[BaseException], ...] = ()
    try:  # only the object stores' extras install aiohttp; local use needs none of it
        import aiohttp

        client = (aiohttp.ClientError,)
    except ImportError:
        pass
    return (*client, asyncio.TimeoutError, ConnectionError, TimeoutError)


def error_for(
    *,
    op: str,
    backend: str,
    key: str | None,
    status: int | None,
    code: str | None = None,
    detail: str = "",
) -> StorageError:
    """The typed error for a failed request, from its HTTP status and service code.

    ``detail`` is the server's message (never a request header, so never a
    credential). 412 is only a "someone else won" when the caller asked for a
    precondition, so callers of ``create`` map it themselves before calling this.
    """
    what = code or (str(status) if status is not None else "error")
    message = f"{op} failed: {what}" + (f": {detail}" if detail and detail != what else "")
    kind: type[StorageError]
    if code in NOT_FOUND_CODES or status == 404:
        kind = NotFoundError
    elif code in PERMISSION_CODES or status in (401, 403):
        kind = PermissionDeniedError
    elif code in TRANSIENT_CODES or status in TRANSIENT_STATUSES or (status or 0) >= 500:
        kind = TransientStorageError
    else:
        kind = StorageError
    return kind(message, backend=backend, key=key)


def transport_error(
    exc: BaseException, *, op: str, backend: str, key: str | None, hint: str = ""
) -> StorageError:
    """A transient error for a connection reset, timeout or similar transport failure;
    ``hint``, where given, says what to check."""
    message = f"{op} failed: {type(exc).__name__}: {redact_text(str(exc))}"
    return TransientStorageError(
        f"{message}; {hint}" if hint else message, backend=backend, key=key
    )


def redact_url(url: str) -> str:
    """``url`` without any ``user:password@`` part, fit for messages and reprs.

    Everything between ``scheme://`` and the last ``@`` goes: a password may itself hold
    ``/``, ``?``, ``#`` or ``@``, which would end a parsed netloc early and leak the rest.
    """
    if "@" not in url:
        return url
    return _USERINFO.sub(r"\1", url)


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://).*@", re.S)

#: In free text a URL's end is unknown: mask up to the token's last "@" (too much, never
#: too little).
_USERINFO_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"<>]*@")
_SIGNED = re.compile(
    r"((?:X-Amz-(?:Signature|Credential|Security-Token)|Signature|AWSAccessKeyId|"
    r"access_token|refresh_token|client_secret|sig|token)=)[^&\s'\"<>]+",
    re.I,
)
#: A header as text (``Authorization: ...``) or in a logged dict (``'X-Amz-Security-Token':
#: b'...'``, the form of botocore's debug lines): a quoted value goes whole.
_AUTH = re.compile(
    r"((?:Authorization|Proxy-Authorization|X-Amz-Security-Token)['\"]?\s*[:=]\s*)"
    r"(?:b?'[^']*'|b?\"[^\"]*\"|\S+)",
    re.I,
)
#: Temporary credentials in a logged response body (STS's XML, a credential service's JSON).
_CREDENTIAL_FIELDS = re.compile(
    r"(<(?:SecretAccessKey|SessionToken)>)[^<]*|"
    r"(\"(?:SecretAccessKey|SessionToken|Token|secret_key|token)\"\s*:\s*)\"[^\"]*\"",
    re.I,
)
_BEARER = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.I)


def redact_text(text: str) -> str:
    """``text`` with credentials masked: URL passwords, signed query parameters, tokens."""
    text = _USERINFO_IN_TEXT.sub(r"\1***@", text)
    text = _SIGNED.sub(r"\1***", text)
    text = _AUTH.sub(r"\1***", text)
    text = _CREDENTIAL_FIELDS.sub(lambda m: (m.group(1) or m.group(2)) + "***", text)
    return _BEARER.sub(r"\1***", text)


def already_exists(*, backend: str, key: str) -> AlreadyExistsError:
    """The error `create` raises when the key is already there."""
    return AlreadyExistsError("create refused: the key already exists", backend=backend, key=key)
