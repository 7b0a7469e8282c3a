"""Saving a tree as one committed checkpoint step.

Protocol (every process runs the same code):

1. everyone checks the step is not committed; process 0 removes leftovers of
   an earlier, uncommitted attempt;
2. each process writes its own shards into its own OCDBT store, with no
   coordination (process 0 also writes every leaf's metadata) and reports;
3. process 0 merges the stores by reference in one atomic transaction,
   validates, writes the manifest and finally creates the commit marker;
4. everyone returns once process 0 published the outcome (or raises its error).

The hand-offs between these steps are `Handoff` rounds.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ckptstore import distributed
from ckptstore.arrays import LeafInfo, describe_leaf, ocdbt_spec, write_leaves
from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.handoff import Handoff
from ckptstore.checkpoint.manifest import ItemManifest, Manifest
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.target import Target, opened
from ckptstore.checkpoint.tree import describe, flatten
from ckptstore.errors import AlreadyExistsError


@dataclass(frozen=True)
class SaveResult:
    """What a committed save did."""

    step: int
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
    await handoff.primary(lambda: remove_leftovers(backend, layout.step_dir(step)))

    async def write_mine() -> dict[str, Any]:
        store = layout.process_store(step, item, handoff.me)
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
        stores = [layout.process_store(step, item, i) for i in range(handoff.count)]
        merged = await merge(backend, layout.item_dir(step, item), stores, leaves)
        item_manifest = ItemManifest(
            structure=structure,
            leaves={info.name: info for info in leaves},
            parts=[s.rsplit("/", 1)[1] for s in stores],
        )
        manifest = Manifest(
            step=step, items={item: item_manifest}, processes=processes, metadata=metadata or {}
        )
        await commit(backend, step, manifest)
        return merged.seconds

    merge_seconds = await handoff.primary(merge_and_commit)
    return SaveResult(
        step=step,
        bytes=sum(info.nbytes for info in leaves),
        bytes_written=int(mine["bytes"]),
        seconds=time.perf_counter() - start,
        merge_seconds=merge_seconds or 0.0,
    )


async def ensure_uncommitted(backend: Backend, step: int) -> None:
    """Raise `AlreadyExistsError` if ``step`` is committed."""
    if await backend.exists(layout.commit_key(step)):
        raise AlreadyExistsError(
            "checkpoint step is already committed", backend=backend.url, key=layout.commit_key(step)
        )


async def remove_leftovers(backend: Backend, prefix: str) -> None:
    """Remove what an earlier, uncommitted attempt left below ``prefix``."""
    if await backend.list_dir(prefix):
        await backend.delete_prefix(prefix)


async def commit(backend: Backend, step: int, manifest: Manifest) -> None:
    """Write the manifest, then create the commit marker: the step is committed after this."""
    await backend.write(layout.manifest_key(step), manifest.to_bytes())
    marker = {"step": step, "token": uuid.uuid4().hex, "time": time.time()}
    await backend.create(layout.commit_key(step), json.dumps(marker).encode())
