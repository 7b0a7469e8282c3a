"""The public Orbax operations: a committed step written as an Orbax checkpoint
(`export_orbax`), an Orbax checkpoint imported as a step (`import_orbax`), and every step
of an Orbax run, or a range (`import_orbax_steps`). Like `ckptstore.api`'s, each tells the
target's kind and hands it to `ckptstore.orbax`; each has its blocking ``_sync`` twin.
"""

from __future__ import annotations

from typing import Any

from ckptstore.api import partial_save, read_manifest
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.partial import PartialSave
from ckptstore.checkpoint.target import Target, opened
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.format import layout
from ckptstore.orbax import exporter, importer
from ckptstore.orbax.exporter import ExportResult
from ckptstore.orbax.importer import (
    DEFAULT_BATCH_BYTES,
    OrbaxImportResult,
    OrbaxStepsImportResult,
)
from ckptstore.runtime.blocking import blocking
from ckptstore.runtime.progress import Progress
from ckptstore.tiers import read as tier_read
from ckptstore.tiers.target import AnyTarget, as_tiered, single


async def export_orbax(
    source: AnyTarget,
    destination: Target,
    *,
    step: int | None = None,
    item: str | None = None,
    manager: bool = False,
    link: bool = True,
    verify: bool = True,
    progress: bool | Progress = False,
) -> ExportResult:
    """Write committed ``step`` (the latest by default) of ``source`` as an Orbax checkpoint.

    ``item``: the array item to write as one tree (default: every item of the step; a step
    of several items, or with JSON items, is written as one Orbax Composite step, a
    directory per item, and `ExportResult.items` names them).

    ``manager=False``: ``destination`` becomes a `StandardCheckpointer` directory,
    ``ocp.StandardCheckpointer().restore(destination)``. ``manager=True``:
    ``destination`` is (or becomes) a `CheckpointManager` root and the step is added
    as ``destination/<step>/``, ``ocp.CheckpointManager(destination).restore(step)``.
    ``link=False`` copies even where hard links would do. ``verify`` reads every leaf
    back through the new view (each chunk's crc32c checked) before the export is
    finished; ``verify=False`` checks only that the view holds every key. An existing destination
    (or step) is `AlreadyExistsError`; nothing is ever written to ``source``.
    On tiers the step is read from the nearest tier with a good copy.
    """

    async def export(src: Backend, at: int | None) -> ExportResult:
        return await exporter.export(src, destination, at, item, manager, link, verify, progress)

    tiers = as_tiered(source)
    if tiers is not None:
        return await tier_read.nearest(tiers, step, export)
    async with opened(single(source)) as src:
        return await export(src, step)


export_orbax_sync = blocking(export_orbax)


async def import_orbax(
    source: Target,
    target: AnyTarget,
    *,
    step: int | None = None,
    item: str | None = None,
    as_step: int | None = None,
    as_item: str = layout.DEFAULT_ITEM,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool | Progress = False,
    codecs: Any = None,
    casts: Any = None,
) -> OrbaxImportResult:
    """Import an Orbax checkpoint into ``target`` as committed step ``as_step``.

    ``step`` picks a `CheckpointManager` step (default: the latest finalized one). Every
    item of it is imported into the one step, committed together (an
    ``ocp.args.Composite`` step's tree items as array items, its ``JsonSave`` items as
    JSON items), under Orbax's item names; ``item`` imports that one alone. Orbax's
    unnamed tree (a single-item step's ``default``, a `StandardCheckpointer` directory)
    is named ``as_item`` (``state``, the manager's default item). ``as_step`` defaults
    to the Orbax step, or 0 for a `StandardCheckpointer` directory. The step's Orbax
    metrics (its ``metrics`` item) become the step's metrics, as ``save(metrics=...)``
    records them. An item the step's ``_CHECKPOINT_METADATA`` lists but that is missing or
    torn is `CorruptCheckpointError` naming it, unless ``item`` leaves it out. The import is
    one partial-save session (a killed import resumes); on tiers, on the fast tier.
    ``codecs`` and ``casts``: how the leaves are stored, as `save`'s (docs/codecs.md).
    """

    async def open_session(at: int, name: str) -> PartialSave:
        return await partial_save(target, at, item=name)  # on tiers: on the fast tier

    return await importer.import_orbax(
        source,
        open_session,
        step=step,
        item=item,
        as_step=as_step,
        as_item=as_item,
        batch_bytes=batch_bytes,
        progress=progress,
        codecs=codecs,
        casts=casts,
    )


import_orbax_sync = blocking(import_orbax)


async def import_orbax_steps(
    source: Target,
    target: AnyTarget,
    *,
    first: int | None = None,
    last: int | None = None,
    item: str | None = None,
    as_item: str = layout.DEFAULT_ITEM,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool | Progress = False,
    codecs: Any = None,
    casts: Any = None,
) -> OrbaxStepsImportResult:
    """Import every finalized step of an Orbax `CheckpointManager` root from ``first`` to
    ``last`` (both included; None: no bound, so by default all of them), each as
    `import_orbax` imports one (its metrics too) under its own step number, so that a
    manager there has the run's history (``best_step``, `KeepBest`). Every step is checked
    before any is written; a step already imported from the same Orbax step is left as it
    is (a rerun resumes), any other committed step there is `AlreadyExistsError`."""

    async def open_session(at: int, name: str) -> PartialSave:
        return await partial_save(target, at, item=name)  # on tiers: on the fast tier

    async def committed(at: int) -> dict[str, Any] | None:
        try:
            return (await read_manifest(target, at)).metadata
        except CheckpointNotFoundError:
            return None

    return await importer.import_orbax_steps(
        source,
        open_session,
        committed,
        first=first,
        last=last,
        item=item,
        as_item=as_item,
        batch_bytes=batch_bytes,
        progress=progress,
        codecs=codecs,
        casts=casts,
    )


import_orbax_steps_sync = blocking(import_orbax_steps)
