"""Where an Orbax 0.12 checkpoint is: a `StandardCheckpointer` directory, or the finalized
steps of a `CheckpointManager` root.

A root's step directories are ``<step>/``, or with Orbax's ``step_prefix`` and
``step_format_fixed_length`` options ``<prefix>_<zero-padded step>/`` (`orbax_step`). A
step counts once it is finalized: it holds ``commit_success.txt``, or (where rename is
atomic, as Orbax renames ``<step>.orbax-checkpoint-tmp-*`` into place)
``_CHECKPOINT_METADATA``. Temporary directories are never steps.
"""

from __future__ import annotations

import asyncio

from ckptstore.backends.base import Backend
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.layout import (
    ORBAX_CHECKPOINT_METADATA,
    ORBAX_COMMIT_SUCCESS,
    ORBAX_TREE_METADATA,
)


def orbax_step(name: str) -> int | None:
    """The step an Orbax step directory's name stands for: ``<step>``, or as Orbax names
    it with ``step_prefix`` (``<prefix>_<step>``) and ``step_format_fixed_length``
    (zero-padded, ``<prefix>_00000100``); None for anything else (temporary directories,
    ``_<step>`` with an empty prefix)."""
    prefix, _, digits = name.rpartition("_")
    if not (digits.isascii() and digits.isdigit()) or (digits != name and not prefix):
        return None
    return int(digits)


async def is_finalized(backend: Backend, step_dir: str) -> bool:
    """Whether ``step_dir`` is a finalized Orbax step (see the module docstring)."""
    names = set(await backend.list_dir(step_dir))
    if ORBAX_COMMIT_SUCCESS in names:
        return True
    return backend.capabilities.atomic_rename and ORBAX_CHECKPOINT_METADATA in names


async def finalized_dirs(backend: Backend, step: int | None = None) -> dict[int, str]:
    """The finalized steps of an Orbax `CheckpointManager` root (only ``step`` where
    given: the other steps' directories are not looked into), ascending, each with its
    directory's name. Two finalized directories for one step (``7`` and ``step_7``) are
    `CorruptCheckpointError`: which one Orbax would read depends on its options."""
    named = sorted(
        (s, n)
        for n in await backend.list_dir()
        if (s := orbax_step(n)) is not None and (step is None or s == step)
    )
    flags = await asyncio.gather(*(is_finalized(backend, n) for _, n in named))
    out: dict[int, str] = {}
    for (step, name), ok in zip(named, flags, strict=True):
        if ok and step in out:
            raise CorruptCheckpointError(
                f"{backend.url} holds Orbax step {step} twice ({out[step]!r} and {name!r}): "
                "move one of them away"
            )
        if ok:
            out[step] = name
    return out


async def finalized_steps(backend: Backend) -> list[int]:
    """The finalized steps of an Orbax `CheckpointManager` root, ascending."""
    return list(await finalized_dirs(backend))


async def locate(backend: Backend, step: int | None) -> str | None:
    """The Orbax directory to read ("" for a `StandardCheckpointer` root, else the step's),
    or None when the backend holds no such Orbax checkpoint."""
    if step is None and await backend.exists(ORBAX_TREE_METADATA):
        return ""
    if step is None:
        dirs = await finalized_dirs(backend)
        return dirs[max(dirs)] if dirs else None
    step = layout.check_step(step)
    return (await finalized_dirs(backend, step)).get(step)
