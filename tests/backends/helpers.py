"""Helpers the backend tests share: a clean environment for subprocesses."""

from __future__ import annotations

import os


def clean_env() -> dict[str, str]:
    """This process's environment without what our own fixtures and conftest set."""
    prefixes = ("AWS_", "STORAGE_EMULATOR", "TENSORSTORE_", "XLA_FLAGS", "JAX_", "CKPTSTORE_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
