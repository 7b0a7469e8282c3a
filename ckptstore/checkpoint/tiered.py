"""Reading any target, a `Tiered` one included: the nearest tier with a good copy.

`list_steps`, `read_manifest`, `restore` and `verify` here are the public entry points
(``ckptstore.restore`` and friends); for a plain target they are those of
`ckptstore.checkpoint.restore` / `ckptstore.checkpoint.verify`. For tiers:

- the steps are those committed on either tier (the union);
- a step is read from the fast tier when it is committed there, else from the durable tier
  (the job moved to new machines: the fast directory is empty);
- a fast copy that fails (`CorruptCheckpointError`: marker, digest, metadata, crc32c; or
  any other typed error of a damaged or partial copy, a missing file say) is skipped with a
  warning when the durable tier has the step: never an error the durable copy could avoid,
  never wrong data. A `TreeMismatchError` (the caller asked for another tree) is raised.

Both tiers hold the same attempt with the same marker (promotion copies it unchanged), so
either one answers with the same tree.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint import restore as plain
from ckptstore.checkpoint import verify as plain_verify
from ckptstore.checkpoint.commit import committed_steps, load_committed
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.checkpoint.target import AnyTarget, Tiered, as_tiered, single
from ckptstore.checkpoint.verify import VerifyReport
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, TreeMismatchError

T = TypeVar("T")
log = logging.getLogger("ckptstore")


async def tier_steps(fast: Backend, durable: Backend) -> list[int]:
    """Steps committed on either tier, ascending."""
    on_fast, on_durable = await asyncio.gather(committed_steps(fast), committed_steps(durable))
    return sorted(set(on_fast) | set(on_durable))


async def _step(fast: Backend, durable: Backend, step: int | None) -> int:
    if step is not None:
        return layout.check_step(step)
    steps = await tier_steps(fast, durable)
    if not steps:
        raise CheckpointNotFoundError(
            "no committed checkpoint on either tier", backend=f"{fast.url} | {durable.url}"
        )
    return steps[-1]


async def nearest(
    tiers: Tiered, step: int | None, read: Callable[[Backend, int], Awaitable[T]]
) -> T:
    """``read(backend, step)`` on the fast tier if it has ``step`` (the latest on either tier
    when None) committed and the read passes its checks, else on the durable tier."""
    async with tiers.opened() as (fast, durable):
        step = await _step(fast, durable, step)
        if await fast.exists(layout.commit_key(step)):
            try:
                return await read(fast, step)
            except TreeMismatchError:
                raise  # the caller's request: the durable copy holds the same tree
            except CkptStoreError as exc:  # damaged or partial: any typed error of a read
                if not await durable.exists(layout.commit_key(step)):
                    raise  # nothing to fall back to: the damage is the answer
                log.warning(
                    "ckptstore: fast copy of step %d is damaged, using the durable tier: %s",
                    step,
                    exc,
                )
        return await read(durable, step)


async def list_steps(target: AnyTarget) -> list[int]:
    """Committed steps, ascending (see `ckptstore.checkpoint.restore.list_steps`); on tiers,
    those committed on either tier."""
    tiers = as_tiered(target)
    if tiers is None:
        return await plain.list_steps(single(target))
    async with tiers.opened() as (fast, durable):
        return await tier_steps(fast, durable)


async def read_manifest(target: AnyTarget, step: int | None = None) -> Manifest:
    """The verified manifest of a committed step (the latest when ``step`` is None), from the
    nearest tier with a good copy."""
    tiers = as_tiered(target)
    if tiers is None:
        return await plain.read_manifest(single(target), step)
    return await nearest(tiers, step, load_committed)


async def restore(
    target: AnyTarget, step: int | None = None, like: Any = None, **kwargs: Any
) -> Any:
    """`ckptstore.checkpoint.restore.restore` (same keywords: ``item``, ``partial``,
    ``cast``, ``max_inflight_bytes``), from the nearest tier with a good copy."""
    tiers = as_tiered(target)
    if tiers is None:
        return await plain.restore(single(target), step, like, **kwargs)

    async def read(backend: Backend, at: int) -> Any:
        return await plain.restore(backend, at, like, **kwargs)

    return await nearest(tiers, step, read)


async def verify(target: AnyTarget, step: int | None = None) -> VerifyReport:
    """Check committed ``step`` end to end (see `ckptstore.checkpoint.verify.verify`).

    On tiers: the copy a restore would read. A damaged fast copy is reported in
    ``skipped`` (and logged) and the durable copy is checked instead, if it has the step.
    """
    tiers = as_tiered(target)
    if tiers is None:
        return await plain_verify.verify(single(target), step)
    async with tiers.opened() as (fast, durable):
        at = await _step(fast, durable, step)
        skipped: dict[str, str] = {}
        if await fast.exists(layout.commit_key(at)):
            report = await plain_verify.verify_step(fast, at)
            report.tier = "fast"
            if report.ok or not await durable.exists(layout.commit_key(at)):
                return report
            log.warning(
                "ckptstore: fast copy of step %d is damaged (%d problems), checking the "
                "durable tier",
                at,
                len(report.problems),
            )
            skipped = {f"{fast.url}/{k}": v for k, v in report.problems.items()}
        report = await plain_verify.verify_step(durable, at)
        report.tier, report.skipped = "durable", skipped
        return report
