"""Where an Orbax export is written, and how it is finished (`ckptstore.orbax.exporter`).

On local disk the export is written in ``DST.orbax-checkpoint-tmp-<ns>`` (Orbax's own
convention) and renamed into place, so DST never looks finished early; elsewhere the
destination is written directly and ``commit_success.txt`` is written last. An existing
destination (or step) is refused before anything is written.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend, fsync_dir
from ckptstore.checkpoint.target import Target, open_target
from ckptstore.errors import AlreadyExistsError
from ckptstore.format.layout import (
    ORBAX_CHECKPOINT_METADATA,
    ORBAX_COMMIT_SUCCESS,
    ORBAX_TREE_METADATA,
)
from ckptstore.orbax.metadata import DEFAULT_ITEM

TMP_MARK = ".orbax-checkpoint-tmp-"


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class Destination:
    """An export's directory: ``step_dir`` (the step, or the checkpoint without
    ``manager``) on ``backend``, and ``item_dir`` for each item written there."""

    def __init__(
        self,
        backend: Backend,
        *,
        owned: bool,
        manager: bool,
        final: str,
        step_dir: str,
        tmp: Path | None = None,
        rename_to: Path | None = None,
    ):
        self.backend, self.owned, self.manager, self.final = backend, owned, manager, final
        self.step_dir, self.tmp, self.rename_to = step_dir, tmp, rename_to

    @classmethod
    async def open(cls, destination: Target, step: int, manager: bool) -> Destination:
        """The export of ``step`` to ``destination`` (a `CheckpointManager` root's new
        step directory with ``manager``); `AlreadyExistsError` where one is there."""
        backend = open_target(destination)
        owned = not isinstance(destination, Backend)
        if isinstance(backend, LocalBackend):
            if owned:
                await backend.close()
            final = backend.root / str(step) if manager else backend.root
            if final.exists() and (not final.is_dir() or any(final.iterdir())):
                raise AlreadyExistsError(f"{final} already exists", backend=backend.url)
            tmp = final.with_name(f"{final.name}{TMP_MARK}{time.time_ns()}")
            tmp.mkdir(parents=True)
            return cls(
                LocalBackend(tmp),
                owned=True,
                manager=manager,
                final=os.fspath(final),
                step_dir="",
                tmp=tmp,
                rename_to=final,
            )
        step_dir = str(step) if manager else ""
        if (
            (await backend.exists(_join(step_dir, ORBAX_COMMIT_SUCCESS)))
            or (not manager and await backend.exists(ORBAX_TREE_METADATA))
            or (not manager and await backend.exists(ORBAX_CHECKPOINT_METADATA))
            or (manager and await backend.list_dir(step_dir))
        ):
            if owned:
                await backend.close()
            raise AlreadyExistsError(
                f"{backend.url}/{step_dir} already holds a checkpoint", backend=backend.url
            )
        where = _join(backend.url, step_dir)
        return cls(backend, owned=owned, manager=manager, final=where, step_dir=step_dir)

    def item_dir(self, name: str | None) -> str:
        """Where item ``name`` goes (a Composite step's item), or (None) the one tree of a
        single-item export: the step's ``default`` item with ``manager``, else the
        directory itself."""
        if name is None:
            name = DEFAULT_ITEM if self.manager else ""
        return _join(self.step_dir, name)

    def success(self) -> bytes:
        """What Orbax writes in ``commit_success.txt``."""
        return f"Checkpoint commit was successful to {self.final}".encode()

    async def finish(self) -> None:
        if self.owned:
            await self.backend.close()
        if self.tmp is not None and self.rename_to is not None:
            _fsync_tree(self.tmp)
            if self.rename_to.is_dir():  # empty (checked at open): the rename replaces it
                self.rename_to.rmdir()
            os.rename(self.tmp, self.rename_to)
            fsync_dir(self.rename_to.parent)

    async def discard(self) -> None:
        """Remove a local temporary directory; elsewhere leave the unfinished export (it
        has no ``commit_success.txt``) for the caller to inspect or delete."""
        if self.owned:
            await self.backend.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """fsync every directory below ``root`` (hard links are directory entries)."""
    for path, _, _ in os.walk(root):
        fsync_dir(Path(path))
