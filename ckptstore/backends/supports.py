"""What some storages have beside bytes on keys: directories, links, temporaries, a free-space
figure, a page cache. Each is an optional protocol a backend implements where its storage has
the thing (a local filesystem has them all; object stores none), beside the byte operations
of `ckptstore.backends.base.Backend` (zarr's ``Supports*`` store protocols are the model).

The checkpoint layer asks through the functions here, which do nothing (or answer "none")
for a backend without the capability, so it never needs to know which backend it holds.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

from ckptstore.backends.base import Backend, Infos, Names


@runtime_checkable
class SupportsDirectories(Protocol):
    """A storage whose keys live in directories that must be made durable and removed."""

    async def sync_dirs(self, prefix: str) -> None:
        """Make every directory below ``prefix`` (and its ancestors up to the root) durable,
        whoever created it, TensorStore included: a commit calls it before its marker, so a
        crash of the machine cannot keep the marker and lose a directory entry it relies on."""

    async def prune_dirs(self, prefix: str) -> None:
        """Remove the empty directories below ``prefix``, then ``prefix`` and each ancestor
        below the root, each only while it is empty (a directory a writer has put something
        into stays), so deleting the last object of a step leaves no empty directory behind."""


@runtime_checkable
class SupportsLinks(Protocol):
    """A storage where a key may lead out of the root (symbolic links)."""

    async def escapes(self, prefix: str) -> Names:
        """Keys below ``prefix`` that lead out of the root, which every read refuses;
        `verify` reports them instead of reading through TensorStore, which would follow them."""


@runtime_checkable
class SupportsTemporaries(Protocol):
    """A storage where a write killed midway leaves a temporary object on the side."""

    async def remove_temporaries(self, older_than: float, *, dry_run: bool = False) -> Infos:
        """Remove the temporary objects `Backend.list` never shows, untouched for
        ``older_than`` seconds (0: every one, so only while no writer runs). Returns them."""


@runtime_checkable
class SupportsFreeSpace(Protocol):
    """A storage with a limit a writer can run into (a filesystem)."""

    async def free_bytes(self) -> int | None:
        """Bytes a writer can still add below the root (None: it cannot tell now)."""


@runtime_checkable
class SupportsWriteBehind(Protocol):
    """A storage whose written data lingers in a local page cache."""

    def write_behind(self, prefix: str) -> contextlib.AbstractContextManager[object]:
        """A context to hold while writing below ``prefix`` through TensorStore, which drops
        what was written from the cache."""


async def sync_dirs(backend: Backend, prefix: str) -> None:
    """`SupportsDirectories.sync_dirs`; nothing where there are no directories."""
    if isinstance(backend, SupportsDirectories):
        await backend.sync_dirs(prefix)


async def prune_dirs(backend: Backend, prefix: str) -> None:
    """`SupportsDirectories.prune_dirs`; nothing where there are no directories."""
    if isinstance(backend, SupportsDirectories):
        await backend.prune_dirs(prefix)


async def escapes(backend: Backend, prefix: str) -> Names:
    """`SupportsLinks.escapes`; none where there are no links."""
    return await backend.escapes(prefix) if isinstance(backend, SupportsLinks) else []


async def remove_temporaries(backend: Backend, older_than: float, *, dry_run: bool) -> Infos:
    """`SupportsTemporaries.remove_temporaries`; none where an object is visible whole or
    not at all (object stores)."""
    if isinstance(backend, SupportsTemporaries):
        return await backend.remove_temporaries(older_than, dry_run=dry_run)
    return []


async def free_bytes(backend: Backend) -> int | None:
    """`SupportsFreeSpace.free_bytes`; None where the storage has no such limit to check."""
    return await backend.free_bytes() if isinstance(backend, SupportsFreeSpace) else None


def write_behind(backend: Backend, prefix: str) -> contextlib.AbstractContextManager[object]:
    """`SupportsWriteBehind.write_behind`; a context doing nothing without a page cache."""
    if isinstance(backend, SupportsWriteBehind):
        return backend.write_behind(prefix)
    return contextlib.nullcontext()
