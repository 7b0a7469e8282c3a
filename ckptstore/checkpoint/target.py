"""Turning what a caller passes as a checkpoint location into a `Backend`."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Union

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend

#: A URL or path, a ``.toml`` profile file, or an open `Backend`.
Target = Union[str, "os.PathLike[str]", Backend]


@asynccontextmanager
async def opened(target: Target) -> AsyncIterator[Backend]:
    """Yield the backend for ``target``; backends opened here are closed afterwards."""
    if isinstance(target, Backend):
        yield target
        return
    path = os.fspath(target)
    if path.endswith(".toml") and os.path.isfile(path):
        backend = open_backend(profile=path)
    else:
        backend = open_backend(path)
    try:
        yield backend
    finally:
        await backend.close()
