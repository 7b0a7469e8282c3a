"""Free space on a local fast tier, checked before a save writes anything.

A save that fills the NVMe fails halfway, leaves a partial attempt behind and may break
whatever else shares the disk. So before a save on a `Tiered` target each process asks its
fast tier how much space is free (``statvfs`` on local disk; object stores have no such
limit and are not checked). If that is less than what this process will write plus the
tier's margin, steps already promoted (committed on the durable tier with the same marker)
(or, on host-local fast tiers, this host's parts of steps committed on the durable tier)
leave the fast tier, oldest first, only as many as needed; if even evicting all of them
would not make room, nothing is evicted and the save fails with `InsufficientSpaceError`.
A step another committed step reads from (an incremental save's base) is not evicted: its
bytes would stay for the step that reads them, so evicting it frees nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ckptstore.backends import supports
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.cleanup import trim_step
from ckptstore.checkpoint.stagedrecord import read_staged, staged_key, staged_steps
from ckptstore.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InsufficientSpaceError,
)
from ckptstore.format import layout
from ckptstore.format.leaves import HostShards, LeafInfo
from ckptstore.protocol import committed_steps, load_committed, read_marker, same_commit
from ckptstore.tiers.hostlocal import drop_staged, is_promoted

log = logging.getLogger("ckptstore")


def bytes_to_write(
    named: Sequence[tuple[str, Any]],
    leaves: Sequence[LeafInfo],
    me: int,
    skip: Collection[str] = (),
) -> int:
    """Payload bytes process ``me`` writes for these leaves, but those named in ``skip``
    (an incremental save references them): of each `jax.Array` its addressable replica-0
    shards (staged: its `HostShards`); every other value belongs to process 0."""
    total = 0
    for (_, value), info in zip(named, leaves, strict=True):
        if info.name in skip:
            continue
        if isinstance(value, HostShards):
            total += sum(piece.nbytes for _, piece in value.pieces)
        elif isinstance(value, jax.Array):
            total += sum(s.data.nbytes for s in value.addressable_shards if s.replica_id == 0)
        elif me == 0:
            total += info.nbytes
    return total


@dataclass(frozen=True)
class Room:
    """What a save on a fast tier must leave free, and where promoted copies live."""

    durable: Backend
    margin: int


async def promoted_steps(fast: Backend, durable: Backend) -> list[int]:
    """Steps on ``fast`` whose durable copy is committed from the same attempt, oldest first:
    committed steps with a byte-identical durable marker, and this host's staged parts
    (`hostlocal`) of steps merged and committed on the durable tier."""
    on_durable = set(await committed_steps(durable))
    committed, staged = await asyncio.gather(committed_steps(fast), staged_steps(fast))
    out = []
    for step in sorted(set(committed) | set(staged)):
        if step not in on_durable:
            continue
        mine = await read_staged(fast, step) if step in staged else None
        if await (is_promoted(durable, mine) if mine else same_commit(fast, durable, step)):
            out.append(step)
    return out


async def _evict(fast: Backend, step: int) -> None:
    if await fast.exists(staged_key(step)):
        await drop_staged(fast, step)
        return
    try:
        await trim_step(fast, step)  # promoted: the durable copy stays
    except CheckpointNotFoundError:  # another process on this host evicted it first
        pass


async def _freeing(fast: Backend, steps: list[int]) -> list[int]:
    """Those of ``steps`` whose eviction frees their bytes: not a step whose committed
    attempt another committed step reads from (an incremental save's base: `trim_step`
    keeps that attempt, so evicting it would free nothing and only unlist it)."""
    referenced: set[tuple[int, str]] = set()
    for step in await committed_steps(fast):
        try:
            manifest = await load_committed(fast, step)
        except (CheckpointNotFoundError, CorruptCheckpointError):  # gone or damaged meanwhile
            continue
        referenced |= {(r.step, r.attempt) for r in manifest.references}
    if not referenced:
        return steps
    out = []
    for step in steps:
        marker = await read_marker(fast, step)  # None: a staged part (never referenced)
        if marker is None or (step, marker.attempt) not in referenced:
            out.append(step)
    return out


async def _step_bytes(backend: Backend, step: int) -> int:
    return sum([info.size async for info in backend.list(layout.step_dir(step))])


async def ensure_room(
    fast: Backend, room: Room, nbytes: int, keep: Collection[int] = ()
) -> list[int]:
    """Make sure ``fast`` has ``nbytes`` plus the margin free, evicting promoted steps
    (oldest first, never those in ``keep``: the save's base) if that is what it takes;
    returns the evicted steps.

    Raises `InsufficientSpaceError` (naming the tier, the bytes needed and free) when even
    evicting every promoted step would not be enough; then nothing is evicted.
    """
    free = await supports.free_bytes(fast)
    needed = nbytes + room.margin
    if free is None or free >= needed:
        return []
    promoted = [s for s in await promoted_steps(fast, room.durable) if s not in keep]
    candidates = await _freeing(fast, promoted)
    sizes = await asyncio.gather(*(_step_bytes(fast, s) for s in candidates))
    if free + sum(sizes) < needed:
        raise InsufficientSpaceError(
            f"not enough free space on the fast tier for this save: it needs {needed} bytes "
            f"({nbytes} to write + {room.margin} margin), {free} are free"
            + (
                f", {free + sum(sizes)} after evicting every promoted step {candidates}"
                if candidates
                else " and no promoted step could be evicted"
            ),
            backend=fast.url,
            needed=needed,
            free=free,
        )
    evicted = []
    for step in candidates:
        await _evict(fast, step)
        evicted.append(step)
        free = await supports.free_bytes(fast)
        if free is None or free >= needed:
            break
    else:
        raise InsufficientSpaceError(
            f"not enough free space on the fast tier for this save after evicting the promoted "
            f"steps {evicted}: it needs {needed} bytes, {free} are free",
            backend=fast.url,
            needed=needed,
            free=free or 0,
        )
    log.info(
        "ckptstore: evicted promoted steps %s from %s to make room for a save", evicted, fast.url
    )
    return evicted
