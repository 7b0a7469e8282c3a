"""Turning what a caller passes as a checkpoint location into a `Backend`."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Union

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend
from ckptstore.errors import ConfigError

#: A URL or path, a ``.toml`` profile file, or an open `Backend`.
Target = Union[str, "os.PathLike[str]", Backend]


def open_target(target: Target) -> Backend:
    """The backend ``target`` names (a new one, unless ``target`` is a `Backend`)."""
    if isinstance(target, Backend):
        return target
    path = os.fspath(target)
    if path.endswith(".toml"):  # a profile, never a directory named like one
        if not os.path.isfile(path):
            raise ConfigError(f"profile {path} does not exist")
        return open_backend(profile=path)
    return open_backend(path)


@asynccontextmanager
async def opened(target: Target) -> AsyncIterator[Backend]:
    """Yield the backend for ``target``; backends opened here are closed afterwards."""
    if isinstance(target, Backend):
        yield target
        return
    backend = open_target(target)
    try:
        yield backend
    finally:
        await backend.close()
