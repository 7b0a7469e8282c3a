"""aiobotocore sessions reused across `S3Backend`s (`ckptstore.backends.awssession`): the
same source, thread and AWS environment share one; anything else makes another."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ckptstore.backends import awssession
from ckptstore.backends.awssession import session_for


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(awssession, "_kept", type(awssession._kept)())


def test_one_session_per_source_thread_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFIRST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first-secret")
    first = session_for("env", None)
    assert session_for("env", None) is first  # another backend, same source
    assert session_for("default", None) is not first
    other: list[Any] = []
    thread = threading.Thread(target=lambda: other.append(session_for("env", None)))
    thread.start()
    thread.join()
    assert other[0] is not first  # botocore sessions are not shared between threads
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated-secret")
    rotated = session_for("env", None)
    assert rotated is not first
    creds = asyncio.run(rotated.get_credentials())
    assert creds is not None and creds.secret_key == "rotated-secret"
    # Only a digest of the environment is kept.
    assert not any("secret" in repr(key) for key in awssession._kept)


def test_few_sessions_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in range(awssession.KEPT + 3):
        monkeypatch.setenv("AWS_REGION", f"region-{k}")
        session_for("env", None)
    assert len(awssession._kept) == awssession.KEPT
