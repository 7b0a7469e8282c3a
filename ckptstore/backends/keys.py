"""Key validation: the rules every backend applies before any I/O.

Keys are ``/``-separated and relative to the backend root. A key never has an
empty segment, a ``.`` or ``..`` segment, a leading ``/``, a backslash or NUL, so it
cannot name anything outside the root. A prefix is the same, but may be empty
(the root) and may end with one ``/``.
"""

from __future__ import annotations

from ckptstore.errors import InvalidKeyError

#: Suffix marker of the local backend's temporary files; never a legal key segment.
TEMP_MARKER = ".ckptstore-tmp."


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid object key, else raise `InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be a str, got {type(key).__name__}")
    if key == "":
        raise InvalidKeyError("key must not be empty")
    _check_segments(key, what="key")
    return key


def validate_prefix(prefix: str) -> str:
    """Normalize a prefix: ``""`` for the root, else the key-like path without a trailing ``/``."""
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"prefix must be a str, got {type(prefix).__name__}")
    if prefix == "" or prefix == "/":
        return ""
    stripped = prefix[:-1] if prefix.endswith("/") else prefix
    _check_segments(stripped, what="prefix", original=prefix)
    return stripped


def join(prefix: str, key: str) -> str:
    """Join a normalized prefix and a key."""
    return f"{prefix}/{key}" if prefix else key


def dir_prefix(root: str, prefix: str) -> str:
    """The object-name prefix (ending in ``/``) of a directory-like ``prefix`` below ``root``."""
    full = join(root, prefix) if prefix else root
    return f"{full}/" if full else ""


def _check_segments(path: str, *, what: str, original: str | None = None) -> None:
    shown = original if original is not None else path
    if "\x00" in path:
        raise InvalidKeyError(f"{what} {shown!r} contains a NUL character")
    if "\\" in path:
        raise InvalidKeyError(f"{what} {shown!r} contains a backslash")
    if path.startswith("/"):
        raise InvalidKeyError(f"{what} {shown!r} must be relative (no leading '/')")
    for segment in path.split("/"):
        if segment == "":
            raise InvalidKeyError(f"{what} {shown!r} has an empty segment")
        if segment in (".", ".."):
            raise InvalidKeyError(f"{what} {shown!r} has a {segment!r} segment")
        if TEMP_MARKER in segment:
            raise InvalidKeyError(f"{what} {shown!r} uses the reserved marker {TEMP_MARKER!r}")
