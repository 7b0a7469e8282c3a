"""Turning what a caller passes as a checkpoint location into a `Backend` (a `Tiered`
pair of them is `ckptstore.tiers.target`'s)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Union

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend, target_profile
from ckptstore.errors import ConfigError

#: A URL or path, a profile (a ``.toml`` file, or a name: `registry.target_profile`), or an
#: open `Backend`.
Target = Union[str, "os.PathLike[str]", Backend]


def open_target(
    target: Target | None,
    *,
    profile: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Backend:
    """The backend ``target`` names (a new one, unless ``target`` is a `Backend`).

    ``None`` means the profile named by ``profile`` or, without one, by ``$CKPTSTORE_PROFILE``.
    ``profile`` and ``options`` apply to a URL target as in `open_backend` (its options,
    with ``options`` overriding them); a target that is itself a ``.toml`` profile takes
    ``options`` but no second profile.
    """
    if not isinstance(target, (str, os.PathLike, Backend)) and target is not None:
        raise ConfigError(
            f"{target!r} is not one backend (a URL, path, profile or Backend); two tiers go to "
            "ckptstore.save, restore, list_steps, verify, promote, ... or open one of them"
        )
    if isinstance(target, Backend):
        if profile is not None or options:
            raise ConfigError(f"{target!r} is already open: a profile or options cannot apply")
        return target
    if target is None:
        return open_backend(profile=profile, **options)
    path = os.fspath(target)
    named = target_profile(path)  # a .toml file, or a bare name of a profile
    if named is not None:
        if profile is not None:
            raise ConfigError(f"two profiles given ({named} and {os.fspath(profile)}): give one")
        if not named.is_file():
            raise ConfigError(f"profile {named} does not exist")
        return open_backend(profile=named, **options)
    return open_backend(path, profile=profile, **options)


@asynccontextmanager
async def opened(target: Target | None, **options: Any) -> AsyncIterator[Backend]:
    """Yield the backend for ``target`` (see `open_target`); backends opened here are closed
    afterwards."""
    if isinstance(target, Backend) and not options:
        yield target
        return
    backend = open_target(target, **options)
    try:
        yield backend
    finally:
        await backend.close()
