"""Saving a tree as one committed checkpoint step.

Protocol (every process runs the same code; see `ckptstore.checkpoint.commit`):

1. everyone checks the step is not committed; process 0 picks a fresh attempt id
   and everyone learns it;
2. each process writes its own shards into its own OCDBT store below that
   attempt, with no coordination (process 0 also writes every leaf's metadata),
   and reports;
3. process 0 merges the stores by reference in one atomic transaction,
   validates, writes the attempt's manifest and creates the commit marker;
4. everyone returns once process 0 published the outcome (or raises its error).

Nothing outside the attempt is written or deleted, so a concurrent writer of
the same step (a preempted job's zombie, say) can never damage what the other
committed: one marker wins, the loser gets `AlreadyExistsError`.
The hand-offs between these steps are `Handoff` rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptstore import distributed
from ckptstore.arrays import ocdbt_spec, write_leaves
from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.commit import commit, ensure_uncommitted
from ckptstore.checkpoint.handoff import Handoff
from ckptstore.checkpoint.manifest import ItemManifest, Manifest
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.target import Target, opened
from ckptstore.checkpoint.tree import describe, flatten
from ckptstore.leaves import LeafInfo, describe_leaf


@dataclass(frozen=True)
class SaveResult:
    """What a committed save did."""

    step: int
    attempt: str
    bytes: int  # payload bytes of the whole tree
    bytes_written: int  # shard bytes this process wrote
    seconds: float
    merge_seconds: float


async def save(
    target: Target,
    tree: Any,
    *,
    step: int,
    item: str = layout.DEFAULT_ITEM,
    metadata: dict[str, Any] | None = None,
    timeout: float = distributed.DEFAULT_TIMEOUT,
) -> SaveResult:
    """Save ``tree`` as checkpoint ``step``; returns once it is committed.

    Raises `AlreadyExistsError` if ``step`` is already committed.
    """
    layout.check_step(step)
    named = flatten(tree)
    leaves = [describe_leaf(name, value) for name, value in named]
    structure = describe(tree)
    async with opened(target) as backend:
        return await _save(backend, named, leaves, structure, step, item, metadata, timeout)


async def _save(
    backend: Backend,
    named: list[tuple[str, Any]],
    leaves: list[LeafInfo],
    structure: dict[str, Any],
    step: int,
    item: str,
    metadata: dict[str, Any] | None,
    timeout: float,
) -> SaveResult:
    start = time.perf_counter()
    handoff = Handoff(f"save/{step}", timeout)
    await ensure_uncommitted(backend, step)

    async def fresh_attempt() -> str:
        return layout.new_attempt()

    where = layout.AttemptDir(step, await handoff.agree(fresh_attempt))

    async def write_mine() -> dict[str, Any]:
        store = where.process_store(item, handoff.me)
        with backend.write_behind(store):
            stats = await write_leaves(
                ocdbt_spec(backend.kvstore_spec(store)),
                backend.ts_context,
                list(zip(leaves, (value for _, value in named), strict=True)),
                process=handoff.me,
                write_metadata=handoff.me == 0,
            )
        return stats.to_json()

    mine = await handoff.everyone(write_mine)

    async def merge_and_commit() -> float:
        processes = await handoff.reports()
        stores = [where.process_store(item, i) for i in range(handoff.count)]
        merged = await merge(backend, where.item(item), stores, leaves)
        item_manifest = ItemManifest(
            structure=structure,
            leaves={info.name: info for info in leaves},
            parts=[s.rsplit("/", 1)[1] for s in stores],
        )
        manifest = Manifest(
            step=step,
            attempt=where.attempt,
            items={item: item_manifest},
            processes=processes,
            metadata=metadata or {},
        )
        await commit(backend, manifest)
        return merged.seconds

    merge_seconds = await handoff.primary(merge_and_commit)
    return SaveResult(
        step=step,
        attempt=str(where.attempt),
        bytes=sum(info.nbytes for info in leaves),
        bytes_written=int(mine["bytes"]),
        seconds=time.perf_counter() - start,
        merge_seconds=merge_seconds or 0.0,
    )
