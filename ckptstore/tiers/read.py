"""Reading a `Tiered` target: the nearest tier with a good copy.

`list_steps`, `read_manifest`, `restore` and `verify` here are what ``ckptstore.restore``
and friends do on tiers (`ckptstore.api` dispatches):

- the steps are those committed on either tier (the union);
- a step is read from the fast tier when it is committed there, else from the durable tier
  (the job moved to new machines: the fast directory is empty); on host-local fast tiers
  (`ckptstore.tiers.hostlocal`) a restore first tries this host's own copy;
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
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from ckptstore.backends.base import Backend
from ckptstore.checkpoint import restore as plain
from ckptstore.checkpoint import verify as plain_verify
from ckptstore.checkpoint.restore import RestoreOptions
from ckptstore.checkpoint.stagedrecord import read_staged
from ckptstore.checkpoint.verify import VerifyReport
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    CorruptCheckpointError,
    TreeMismatchError,
)
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import committed_steps, is_committed, load_committed
from ckptstore.runtime.distributed import DEFAULT_TIMEOUT
from ckptstore.tiers.bounded import durable_steps
from ckptstore.tiers.target import Tiered

T = TypeVar("T")
log = logging.getLogger("ckptstore")


async def tier_steps(fast: Backend, durable: Backend) -> list[int]:
    """Steps committed on either tier, ascending."""
    on_fast, on_durable = await asyncio.gather(committed_steps(fast), committed_steps(durable))
    return sorted(set(on_fast) | set(on_durable))


async def _step(fast: Backend, durable: Backend, step: int | None) -> int:
    """``step``, or the latest committed on either tier; while the durable tier does not
    answer (`bounded.durable_steps`), the fast tier's latest, with a warning: a restart
    during an outage restores what the fast tier holds (its newest steps)."""
    if step is not None:
        return layout.check_step(step)
    steps = await steps_now(fast, durable)
    if not steps:
        raise CheckpointNotFoundError(
            "no committed checkpoint on either tier", backend=f"{fast.url} | {durable.url}"
        )
    return steps[-1]


async def nearest(
    tiers: Tiered,
    step: int | None,
    read: Callable[[Backend, int], Awaitable[T]],
    read_host: Callable[[Backend, Manifest], Awaitable[T]] | None = None,
    staged: Manifest | None = None,
) -> T:
    """``read(backend, step)`` on the fast tier if it has ``step`` (the latest on either tier
    when None) committed and the read passes its checks, else on the durable tier.

    ``read_host(fast, manifest)``: where the step is staged on a host-local fast tier
    (`hostlocal`) with this host's own copy of the attempt the durable tier committed (or
    of the attempt ``staged`` describes, a step not promoted yet: `tiers.offline`), that
    copy is tried first (same hosts, same topology: it holds every slice this host's
    devices held); a read it cannot serve (another topology, damage) goes to the durable
    tier with a warning.
    """
    async with tiers.opened() as (fast, durable):
        step = await _step(fast, durable, step)
        if await is_committed(fast, step):
            try:
                result = await read(fast, step)
                log.info("ckptstore: step %d read from the fast tier", step)
                return result
            except TreeMismatchError:
                raise  # the caller's request: the durable copy holds the same tree
            except CkptStoreError as exc:  # damaged or partial: any typed error of a read
                if not await is_committed(durable, step):
                    raise  # nothing to fall back to: the damage is the answer
                log.warning(
                    "ckptstore: fast copy of step %d is damaged, using the durable tier: %s",
                    step,
                    exc,
                )
        elif read_host is not None and (manifest := await host_copy(fast, durable, step, staged)):
            try:
                result = await read_host(fast, manifest)
                log.info("ckptstore: step %d read from this host's fast copy", step)
                return result
            except TreeMismatchError:
                raise
            except CkptStoreError as exc:
                log.warning(
                    "ckptstore: this host's fast copy of step %d cannot serve this restore "
                    "(another topology, or damage), using the durable tier: %s",
                    step,
                    exc,
                )
        result = await read(durable, step)
        log.info("ckptstore: step %d read from the durable tier", step)
        return result


async def host_copy(
    fast: Backend, durable: Backend, step: int, staged: Manifest | None = None
) -> Manifest | None:
    """The durable tier's verified manifest of ``step`` (or ``staged``, given: the manifest
    of a step not promoted yet) when this host's fast tier holds its own copy
    (`hostlocal.write_host_view`) of the very attempt it describes."""
    try:
        mine = await read_staged(fast, step)
    except CorruptCheckpointError as exc:
        log.warning("ckptstore: ignoring this host's fast copy of step %d: %s", step, exc)
        return None
    if mine is None or not mine.host_view:
        return None
    if staged is None:
        if not await is_committed(durable, step):
            return None
        staged = await load_committed(durable, step)
    return staged if staged.attempt == mine.attempt else None


async def list_steps(tiers: Tiered) -> list[int]:
    """Steps committed on either tier, ascending."""
    async with tiers.opened() as (fast, durable):
        return await tier_steps(fast, durable)


async def read_manifest(
    tiers: Tiered, step: int | None = None, staged: Manifest | None = None
) -> Manifest:
    """The verified manifest of a committed step (the latest when ``step`` is None), from the
    nearest tier with a good copy; ``staged``: the manifest of ``step`` staged on host-local
    fast tiers and not promoted yet (`tiers.offline`), which is the answer."""
    if staged is not None and staged.step == step:
        return staged
    return await nearest(tiers, step, load_committed)


async def steps_now(
    fast: Backend, durable: Backend, staged: Iterable[int] = (), timeout: float = DEFAULT_TIMEOUT
) -> list[int]:
    """The steps a job on these tiers can restore now, ascending: those committed on the fast
    tier, those ``staged`` on every host and not promoted yet (`tiers.offline`), and those
    committed on the durable tier as far as it answers within ``timeout`` (while it is down,
    the others, with a warning: `bounded.durable_steps`)."""
    on_durable = await durable_steps(durable, timeout)
    return sorted(set(await committed_steps(fast)) | set(staged) | set(on_durable or []))


async def restore(
    tiers: Tiered,
    step: int | None,
    like: Any,
    options: RestoreOptions,
    staged: Manifest | None = None,
) -> Any:
    """Restore a committed step (the latest when None) from the nearest tier with a good
    copy, as `ckptstore.checkpoint.restore.restore` does on one backend; ``staged``: the
    manifest of ``step`` staged on host-local fast tiers and not promoted yet, read from
    this host's own copy (`tiers.offline`)."""

    async def read(backend: Backend, at: int) -> Any:
        return await plain.restore(backend, at, like, options)

    async def read_host(fast: Backend, manifest: Manifest) -> Any:
        return await plain.restore_manifest(fast, manifest, like, options)

    return await nearest(tiers, step, read, read_host, staged)


async def verify(
    tiers: Tiered,
    step: int | None = None,
    *,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    progress: plain_verify.ProgressFn | None = None,
) -> VerifyReport:
    """Check committed ``step`` end to end (`ckptstore.checkpoint.verify.verify_step`): the copy
    a restore would read. A damaged fast copy is reported in ``skipped`` (and logged) and
    the durable copy is checked instead, if it has the step.
    """
    async with tiers.opened() as (fast, durable):
        at = await _step(fast, durable, step)
        skipped: dict[str, str] = {}
        if await is_committed(fast, at):
            report = await plain_verify.verify_step(
                fast, at, max_inflight_bytes=max_inflight_bytes, progress=progress
            )
            report.tier = "fast"
            if report.ok or not await is_committed(durable, at):
                return report
            log.warning(
                "ckptstore: fast copy of step %d is damaged (%d problems), checking the "
                "durable tier",
                at,
                len(report.problems) + len(report.unreadable),
            )
            bad = {**report.problems, **report.unreadable}
            skipped = {f"{fast.url}/{k}": v for k, v in bad.items()}
        report = await plain_verify.verify_step(
            durable, at, max_inflight_bytes=max_inflight_bytes, progress=progress
        )
        report.tier, report.skipped = "durable", skipped
        return report
