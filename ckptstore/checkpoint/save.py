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
from collections.abc import Coroutine
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
            "checkpoint step is already committed",
            backend=backend.url,
            key=layout.commit_key(step),
        )

    # Every hand-off goes through the coordination service's key-value store, so
    # a process that fails publishes its error and the others stop at once
    # instead of waiting for a barrier to time out.
    if me == 0:
        await _publish(f"{tag}/start", _leftovers_removed(backend, step))
    await _outcome(f"{tag}/start", timeout, step)

    try:
        stats = await write_leaves(
            ocdbt_spec(backend.kvstore_spec(layout.process_store(step, item, me))),
            backend.ts_context,
            list(zip(leaves, (value for _, value in named), strict=True)),
            process=me,
            write_metadata=me == 0,
        )
    except Exception as exc:
        await distributed.kv_set(f"{tag}/written/{me}", _failure(exc))
        if me == 0:
            await distributed.kv_set(f"{tag}/outcome", _failure(exc))
        raise
    await distributed.kv_set(f"{tag}/written/{me}", json.dumps({"ok": True, **stats.to_json()}))

    merge_seconds = 0.0
    if me == 0:

        async def finish() -> None:
            nonlocal merge_seconds
            processes = []
            for i in range(count):
                report = json.loads(await distributed.kv_get(f"{tag}/written/{i}", timeout))
                if not report.pop("ok"):
                    raise CkptStoreError(f"process {i} failed to write: {report['error']}")
                processes.append(report)
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

        await _publish(f"{tag}/outcome", finish())
    await _outcome(f"{tag}/outcome", timeout, step)

    return SaveResult(
        step=step,
        bytes=sum(info.nbytes for info in leaves),
        bytes_written=stats.bytes,
        seconds=time.perf_counter() - start,
        merge_seconds=merge_seconds,
    )


async def _leftovers_removed(backend: Backend, step: int) -> None:
    """Remove what an earlier, uncommitted attempt at ``step`` left behind."""
    if await backend.list_dir(layout.step_dir(step)):
        await backend.delete_prefix(layout.step_dir(step))


def _failure(exc: BaseException) -> str:
    return json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def _publish(key: str, work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` and publish its outcome under ``key``; re-raise its error here."""
    try:
        await work
    except Exception as exc:
        await distributed.kv_set(key, _failure(exc))
        raise
    await distributed.kv_set(key, json.dumps({"ok": True}))


async def _outcome(key: str, timeout: float, step: int) -> None:
    """Wait for the outcome process 0 published under ``key``; raise if it failed."""
    if distributed.process_index() == 0:
        return  # process 0 raised its own error already
    outcome = json.loads(await distributed.kv_get(key, timeout))
    if not outcome["ok"]:
        raise CkptStoreError(f"saving step {step} failed on process 0: {outcome['error']}")


async def commit(backend: Backend, step: int, manifest: Manifest) -> None:
    """Write the manifest, then create the commit marker: the step is committed after this."""
    await backend.write(layout.manifest_key(step), manifest.to_bytes())
    marker = {"step": step, "token": uuid.uuid4().hex, "time": time.time()}
    await backend.create(layout.commit_key(step), json.dumps(marker).encode())
