"""Saving a tree as one committed checkpoint step.

Protocol (every process runs the same code):

1. everyone checks the step is not committed; process 0 removes leftovers of
   an earlier, uncommitted attempt; barrier;
2. each process writes its own shards into its own OCDBT store, with no
   coordination; process 0 also writes every leaf's metadata; barrier;
3. process 0 merges the stores by reference in one atomic transaction,
   validates, writes the manifest and finally creates the commit marker;
4. process 0 publishes the outcome; everyone returns it (or raises its error).
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
from ckptstore.checkpoint.manifest import ItemManifest, Manifest
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.target import Target, opened
from ckptstore.checkpoint.tree import describe, flatten
from ckptstore.errors import AlreadyExistsError, CkptStoreError


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
    me, count = distributed.process_index(), distributed.process_count()
    tag = distributed.unique_name(f"save/{step}")

    if await backend.exists(layout.commit_key(step)):
        raise AlreadyExistsError(
            "checkpoint step is already committed", backend=backend.url, key=layout.commit_key(step)
        )
    if me == 0 and await backend.list_dir(layout.step_dir(step)):
        await backend.delete_prefix(layout.step_dir(step))  # an earlier attempt's leftovers
    await distributed.barrier(f"{tag}/start", timeout)

    stats = await write_leaves(
        ocdbt_spec(backend.kvstore_spec(layout.process_store(step, item, me))),
        backend.ts_context,
        list(zip(leaves, (value for _, value in named), strict=True)),
        process=me,
        write_metadata=me == 0,
    )
    await distributed.kv_set(f"{tag}/stats/{me}", json.dumps(stats.to_json()))
    await distributed.barrier(f"{tag}/written", timeout)

    merge_seconds = 0.0
    if me == 0:
        outcome: dict[str, Any]
        try:
            processes = [
                json.loads(await distributed.kv_get(f"{tag}/stats/{i}", timeout))
                for i in range(count)
            ]
            stores = [layout.process_store(step, item, i) for i in range(count)]
            merged = await merge(backend, layout.item_dir(step, item), stores, leaves)
            merge_seconds = merged.seconds
            manifest = Manifest(
                step=step,
                items={
                    item: ItemManifest(
                        structure=structure,
                        leaves={info.name: info for info in leaves},
                        parts=[s.rsplit("/", 1)[1] for s in stores],
                    )
                },
                processes=processes,
                metadata=metadata or {},
            )
            await commit(backend, step, manifest)
            outcome = {"ok": True}
        except Exception as exc:
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            await distributed.kv_set(f"{tag}/outcome", json.dumps(outcome))
            raise
        await distributed.kv_set(f"{tag}/outcome", json.dumps(outcome))
    else:
        outcome = json.loads(await distributed.kv_get(f"{tag}/outcome", timeout))
        if not outcome["ok"]:
            raise CkptStoreError(f"process 0 failed to commit step {step}: {outcome['error']}")

    return SaveResult(
        step=step,
        bytes=sum(info.nbytes for info in leaves),
        bytes_written=stats.bytes,
        seconds=time.perf_counter() - start,
        merge_seconds=merge_seconds,
    )


async def commit(backend: Backend, step: int, manifest: Manifest) -> None:
    """Write the manifest, then create the commit marker: the step is committed after this."""
    await backend.write(layout.manifest_key(step), manifest.to_bytes())
    marker = {"step": step, "token": uuid.uuid4().hex, "time": time.time()}
    await backend.create(layout.commit_key(step), json.dumps(marker).encode())
