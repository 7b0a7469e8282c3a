"""aiobotocore sessions for `S3Backend`, reused while their inputs stay the same.

A client made from a new session took 50-120 ms here (botocore loads its service models per
session), from a session that made one before ~3 ms; every ``save("s3://...")`` opens a
backend, so a session per backend cost each such save that much before its first request.
A session is reused for the same credential source and profile, on the same thread (botocore
sessions are not safe to share between threads), while the process's ``AWS_*`` environment
is the same (rotated credentials in the environment make a new one). Only a digest of the
environment is kept, never a value of it.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from typing import Any

#: Sessions kept at most (the oldest goes first).
KEPT = 8

_kept: collections.OrderedDict[tuple[str, str | None, int, str], Any] = collections.OrderedDict()
_lock = threading.Lock()


def session_for(credentials: str, profile: str | None) -> Any:
    """An aiobotocore session resolving credentials from ``credentials`` only ("env":
    the environment; "profile": ``profile``; otherwise botocore's default chain), reused
    as the module docstring says. A missing profile shows at the first request
    (`S3Backend` names it in a `ConfigError`), not here."""
    key = (credentials, profile, threading.get_ident(), _environment())
    with _lock:
        found = _kept.get(key)
        if found is not None:
            _kept.move_to_end(key)
            return found
    session = _new_session(credentials, profile)
    with _lock:
        _kept[key] = session
        while len(_kept) > KEPT:
            _kept.popitem(last=False)
    return session


def _new_session(credentials: str, profile: str | None) -> Any:
    from aiobotocore.credentials import AioCredentialResolver, AioEnvProvider
    from aiobotocore.session import AioSession

    if credentials == "profile":
        return AioSession(profile=profile)
    session = AioSession()
    if credentials == "env":
        session.register_component("credential_provider", AioCredentialResolver([AioEnvProvider()]))
    return session


def _environment() -> str:
    """A digest of every ``AWS_*`` variable of the environment (names and values)."""
    found = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    return hashlib.sha256(repr(found).encode()).hexdigest()
