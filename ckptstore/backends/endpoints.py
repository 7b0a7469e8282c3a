"""Endpoint URLs checked by ckptstore before any SDK (aiobotocore, gcsfs, TensorStore) sees them.

An endpoint comes from an option (``endpoint``, ``--endpoint``) or an environment variable
(``$AWS_ENDPOINT_URL_S3``, ``$AWS_ENDPOINT_URL``, ``$STORAGE_EMULATOR_HOST``,
``$TENSORSTORE_GCS_HTTP_URL``). Left to the SDKs, a malformed one (``u:pw@host:9000``,
``http//u:pw@host``) comes back as an untyped error that quotes it whole, password
included, and a well-formed one with ``user:password@`` travels into their debug logs.
`check_endpoint` refuses both with a `ConfigError` that names the field the value came
from and shows the value with everything up to its last ``@`` masked.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from ckptstore.backends._errors import redact_text
from ckptstore.errors import ConfigError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: ``host[:port]`` without a scheme: what ``$STORAGE_EMULATOR_HOST`` conventionally holds.
_BARE_HOST = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$"
)
SHOWN_CHARS = 120


def mask_userinfo(value: str) -> str:
    """``value`` with everything between its scheme (if any) and its last ``@`` masked.

    Too much rather than too little: a password may itself hold ``/``, ``:`` or ``@``, and a
    value without a valid scheme has no netloc to parse.
    """
    if "@" not in value:
        return value
    scheme = _SCHEME.match(value)
    return (scheme.group(0) if scheme else "") + "***@" + value[value.rindex("@") + 1 :]


def shown(value: str) -> str:
    """``value`` fit for a message: userinfo, query string and fragment masked, trimmed."""
    text = redact_text(re.sub(r"[?#].*", "?***", mask_userinfo(value), flags=re.S))
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def check_endpoint(value: object, field: str, *, bare_host: bool = False) -> str:
    """``value`` as an ``http(s)://host[:port][/path]`` endpoint, or `ConfigError` naming
    ``field`` (the option or environment variable it came from).

    ``bare_host``: a ``host[:port]`` without a scheme is taken as ``http://host[:port]`` (the
    emulator convention of ``$STORAGE_EMULATOR_HOST``); the result then has no trailing
    ``/``. Credentials in the URL (anything with an ``@``) are refused, never passed on.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{field} must be a string (an http:// or https:// URL)")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(f"{field} holds whitespace or control characters: {shown(value)!r}")
    note = (
        "must not carry credentials (an endpoint URL is never sent with user:password@; "
        "give them through the credential source: credentials=..., the SDK's environment "
        "or files)"
    )
    if _SCHEME.match(value) is None:
        if bare_host and "@" not in value and _BARE_HOST.match(value):
            return f"http://{value}"
        also = f" and {note}" if "@" in value else ""
        raise ConfigError(
            f"{field} must be an http:// or https:// URL (scheme://host[:port]){also}; "
            f"got {shown(value)!r}"
        )
    if "@" in value:
        raise ConfigError(f"{field} {note}; got {shown(value)!r}")
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https"):
        raise ConfigError(
            f"{field} must be an http:// or https:// URL, got scheme {parts.scheme!r} "
            f"in {shown(value)!r}"
        )
    try:
        parts.port  # noqa: B018 - checks it
    except ValueError:
        # Not shown: "http://user:password" (the host forgotten) parses as a port.
        raise ConfigError(
            f"{field} has no valid port: {parts.scheme}://{parts.hostname or ''}:***"
        ) from None
    if not parts.hostname:
        raise ConfigError(f"{field} names no host: {shown(value)!r}")
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ConfigError(f"{field} must not carry a query string or fragment: {shown(value)!r}")
    return value.rstrip("/") if bare_host else value
