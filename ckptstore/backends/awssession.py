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

import threading
from typing import Any

from ckptstore.backends.kept import Kept, environment_digest

#: Sessions kept at most (the oldest goes first).
KEPT = 8

_kept: Kept[tuple[str, str | None, int, str], Any] = Kept(KEPT)


def session_for(credentials: str, profile: str | None) -> Any:
    """An aiobotocore session resolving credentials from ``credentials`` only ("env":
    the environment; "profile": ``profile``; otherwise botocore's default chain), reused
    as the module docstring says. A missing profile shows at the first request
    (`S3Backend` names it in a `ConfigError`), not here."""
    key = (credentials, profile, threading.get_ident(), environment_digest("AWS_"))
    found = _kept.get(key)
    if found is None:
        found = _new_session(credentials, profile)
        _kept.put(key, found)
    return found


def _new_session(credentials: str, profile: str | None) -> Any:
    from aiobotocore.credentials import AioCredentialResolver, AioEnvProvider
    from aiobotocore.session import AioSession

    if credentials == "profile":
        return AioSession(profile=profile)
    session = AioSession()
    if credentials == "env":
        session.register_component("credential_provider", AioCredentialResolver([AioEnvProvider()]))
    return session
