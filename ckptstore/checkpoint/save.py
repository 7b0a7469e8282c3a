"""Saving a tree as one committed checkpoint step.

Protocol (every process runs the same code; see `ckptstore.checkpoint.commit`):

1. everyone checks the step is not committed; process 0 picks a fresh attempt id
   and everyone learns it;
2. each process writes its own shards into its own OCDBT store below that
   attempt, with no coordination (process 0 also writes every leaf's metadata),
   and reports;
3. process 0 claims the attempt's fate for its commit (a `gc` that decided to
   collect it first wins, and the save fails with `FencedError`), merges the stores
   by reference in one atomic transaction, validates, writes the attempt's manifest
   and creates the commit marker;
4. everyone returns once process 0 published the outcome (or raises its error).

Nothing outside the attempt is written or deleted, so a concurrent writer of
the same step (a preempted job's zombie, say) can never damage what the other
committed: one marker wins, the loser gets `AlreadyExistsError`.
The hand-offs between these steps are `Handoff` rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.commit import (
    ABANDON,
    COMMIT,
    claim,
    clear_attempt,
    commit,
    ensure_uncommitted,
    new_owner,
)
from ckptstore.checkpoint.hostlocal import (
    can_write_host_view,
    fast_is_shared,
    host_view_bytes,
    stage,
    staged_key,
    write_host_view,
)
from ckptstore.checkpoint.manifest import ItemManifest, Manifest
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.room import Room, bytes_to_write, ensure_room
from ckptstore.checkpoint.target import AnyTarget, as_tiered, opened, single
from ckptstore.checkpoint.tree import describe, flatten
from ckptstore.datapath.arrays import ocdbt_spec, write_leaves
from ckptstore.errors import AlreadyExistsError, CkptStoreError, FencedError, NotFoundError
from ckptstore.format.leaves import LeafInfo, describe_leaf, storable
from ckptstore.format.packs import PackRef, PackTarget, check_packs, read_index, write_index
from ckptstore.runtime import distributed
from ckptstore.runtime.gcpause import gc_paused
from ckptstore.runtime.handoff import Handoff

log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class SaveResult:
    """What a committed save did."""

    step: int
    attempt: str
    bytes: int  # payload bytes of the whole tree (every item)
    bytes_written: int  # shard bytes this process wrote
    seconds: float
    merge_seconds: float
    #: Seconds per phase on this process: "write" (its shards), "merge" and "commit"
    #: (process 0; the others waited for them).
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PreparedItem:
    """A tree flattened and described before anything is written (bad leaves fail here)."""

    named: list[tuple[str, Any]]
    leaves: list[LeafInfo]
    structure: dict[str, Any]

    @classmethod
    def of(cls, tree: Any) -> PreparedItem:
        # The collector paused for this short, synchronous step only (see `gcpause`): a
        # full collection here cost 5,000-leaf saves ~80 ms (median 151 -> 70 ms).
        with gc_paused():
            named = flatten(tree)
            infos = [describe_leaf(n, v) for n, v in named]
            if any(info.prng_impl for info in infos):  # typed PRNG keys: write their data
                named = [(n, storable(v)) for n, v in named]
            return cls(named, infos, describe(tree))


async def save(
    target: AnyTarget,
    tree: Any,
    *,
    step: int,
    item: str = layout.DEFAULT_ITEM,
    metadata: dict[str, Any] | None = None,
    timeout: float = distributed.DEFAULT_TIMEOUT,
) -> SaveResult:
    """Save ``tree`` as checkpoint ``step``; returns once it is committed.

    On a `Tiered` target (or a profile with a ``[tiers]`` table) the step is saved and
    committed on the fast tier, after checking it has room (see `ensure_room`); promotion
    to the durable tier is separate (``ckptstore.promote``, the manager, ``ckptstore
    promote``). Raises `AlreadyExistsError` if ``step`` is already committed (on the
    fast tier, for tiers).
    """
    return await save_items(target, {item: tree}, step=step, metadata=metadata, timeout=timeout)


async def save_items(
    target: AnyTarget,
    items: Mapping[str, Any],
    *,
    step: int,
    metadata: dict[str, Any] | None = None,
    timeout: float = distributed.DEFAULT_TIMEOUT,
    timings: dict[str, float] | None = None,
) -> SaveResult:
    """Save several trees (items, e.g. the train state and a data-iterator state) as one
    step, committed together; restore reads any of them by name."""
    step = layout.check_step(step)
    if not items:
        raise CkptStoreError("nothing to save: no items")
    prepared = {layout.check_item(name): PreparedItem.of(tree) for name, tree in items.items()}
    tiers = as_tiered(target)
    if tiers is None:
        async with opened(single(target)) as backend:
            return await _save(backend, prepared, step, metadata, timeout, timings or {})
    async with tiers.opened() as (fast, durable):
        room = Room(durable, tiers.free_margin)
        return await _save(fast, prepared, step, metadata, timeout, timings or {}, room)


async def _save(
    backend: Backend,
    items: dict[str, PreparedItem],
    step: int,
    metadata: dict[str, Any] | None,
    timeout: float,
    timings: dict[str, float],
    room: Room | None = None,
) -> SaveResult:
    start = time.perf_counter()
    handoff = Handoff(f"save/{step}", timeout)
    await ensure_uncommitted(backend, step)
    host_local = host_view = False
    if room is not None:  # tiers: every process checks its own fast tier; one failing fails all
        host_local = not await fast_is_shared(backend, handoff)  # see `hostlocal`
        values = [value for item in items.values() for _, value in item.named]
        if host_local:
            await ensure_uncommitted(room.durable, step)
            host_view = can_write_host_view(values, handoff.me)

        async def make_room() -> dict[str, Any]:
            if host_local and await backend.exists(staged_key(step)):
                raise AlreadyExistsError(
                    f"step {step} is already staged", backend=backend.url, key=staged_key(step)
                )
            mine = sum(bytes_to_write(i.named, i.leaves, handoff.me) for i in items.values())
            if host_view:
                mine += host_view_bytes(values, handoff.me)
            return {"evicted": await ensure_room(backend, room, mine)}

        await handoff.everyone(make_room)
        await handoff.primary(handoff.reports)

    async def fresh_attempt() -> str:
        return layout.new_attempt()

    where = layout.AttemptDir(step, await handoff.agree(fresh_attempt))
    owner = new_owner()  # process 0's name in the attempt's fate record

    async def write_mine() -> dict[str, Any]:
        total: dict[str, Any] = {"process": handoff.me, "shards": 0, "bytes": 0, "seconds": 0.0}
        packed: dict[str, int] = {}  # per item, the leaves this process packed
        for name, item in items.items():
            store = where.process_store(name, handoff.me)
            # Small leaves go into packs, except on a host-local fast tier: its promotion
            # and this host's own copy (`hostlocal`) read only OCDBT stores.
            packs = None if host_local else PackTarget(backend, where.item(name), _last(store))
            with backend.write_behind(store):
                stats = await write_leaves(
                    ocdbt_spec(backend.kvstore_spec(store)),
                    backend.ts_context,
                    list(zip(item.leaves, (value for _, value in item.named), strict=True)),
                    process=handoff.me,
                    write_metadata=handoff.me == 0,
                    packs=packs,
                )
            for key in ("shards", "bytes", "seconds"):
                total[key] += stats.to_json()[key]
            if stats.packed:
                await write_index(backend, store, stats.packed)
            packed[name] = len(stats.packed)
        total[_PACKED] = packed
        if host_view:  # this host's copy, for a restart on the same hosts (`hostlocal`)
            for name, item in items.items():
                leaves = list(zip(item.leaves, (value for _, value in item.named), strict=True))
                await write_host_view(backend, where, name, leaves, handoff.me)
        return total

    try:
        mine = await handoff.everyone(write_mine)
    except NotFoundError as exc:
        if (missing := await _root_missing(backend)) is not None:  # a missing bucket
            raise NotFoundError(
                f"{missing.message}: nothing was saved", backend=backend.url
            ) from exc
        await _discard(backend, where, handoff, owner)
        raise
    except Exception:
        await _discard(backend, where, handoff, owner)
        raise
    written = time.perf_counter()
    phases: dict[str, float] = {}

    committing = False  # from the commit (or staging) on, nothing of the attempt is discarded

    async def merge_and_commit() -> None:
        nonlocal committing
        reports = await handoff.reports()
        fate = await claim(backend, where, COMMIT, owner)  # before the first shared write
        processes = [{k: v for k, v in p.items() if k != _PACKED} for p in reports]
        manifest_items = {}
        for name, item in items.items():
            stores = [where.process_store(name, i) for i in range(handoff.count)]
            packed = await _packed(backend, where, name, item.leaves, reports)
            infos = {info.name: info for info in item.leaves}
            if not host_local:  # host-local: merged on the durable tier at promotion
                unpacked = [info for info in item.leaves if info.name not in packed]
                await merge(backend, where.item(name), stores, unpacked)
                await check_packs(
                    backend, where.item(name), [(infos[n], ref) for n, ref in packed.items()]
                )
            manifest_items[name] = ItemManifest(
                structure=item.structure,
                leaves=infos,
                parts=[_last(s) for s in stores],
                packed=packed,
            )
        merged = time.perf_counter()
        phases["merge"] = merged - written
        manifest = Manifest(
            step=step,
            attempt=where.attempt,
            items=manifest_items,
            processes=processes,
            metadata=metadata or {},
            timings={
                **timings,
                "write": max(p["seconds"] for p in processes),
                "merge": phases["merge"],
            },
        )
        committing = True
        if host_local:
            await stage(backend, step, str(where.attempt), 0, handoff.count, manifest, host_view)
        else:
            await commit(backend, manifest, fate)
        phases["commit"] = time.perf_counter() - merged

    try:
        await handoff.primary(merge_and_commit)
    except Exception:
        if not committing:
            await _discard(backend, where, handoff, owner)
        raise
    if host_local:  # every other process stages its part; the save returns once all have

        async def stage_mine() -> dict[str, Any]:
            if handoff.me != 0:
                await stage(
                    backend, step, str(where.attempt), handoff.me, handoff.count, None, host_view
                )
            return {}

        await handoff.everyone(stage_mine)
        await handoff.primary(handoff.reports)
    return SaveResult(
        step=step,
        attempt=str(where.attempt),
        bytes=sum(info.nbytes for item in items.values() for info in item.leaves),
        bytes_written=int(mine["bytes"]),
        seconds=time.perf_counter() - start,
        merge_seconds=phases.get("merge", 0.0),
        timings={"write": written - start, **phases},
    )


_PACKED = "packed"  # a process's report: per item, how many leaves it packed
#: How long process 0 of a failed save waits for the others to stop writing (each reports
#: when its writes end) before it removes the attempt; past it, `gc` removes it later.
DISCARD_WAIT = 60.0


async def _packed(
    backend: Backend,
    where: layout.AttemptDir,
    item: str,
    leaves: Sequence[LeafInfo],
    reports: Sequence[dict[str, Any]],
) -> dict[str, PackRef]:
    """Every process's packed leaves of ``item`` (from the index each wrote beside its
    packs), in the saved leaves' order. A leaf two processes packed, or one the tree does
    not have, is a bug worth stopping the save for."""
    found: dict[str, PackRef] = {}
    for i, report in enumerate(reports):
        if not report.get(_PACKED, {}).get(item):
            continue
        for leaf, ref in (await read_index(backend, where.process_store(item, i))).items():
            if leaf in found:
                raise CkptStoreError(f"leaf {leaf!r} was packed by two processes")
            found[leaf] = ref
    out = {info.name: found.pop(info.name) for info in leaves if info.name in found}
    if found:
        raise CkptStoreError(f"packed leaves the tree does not have: {sorted(found)[:5]}")
    return out


async def _root_missing(backend: Backend) -> NotFoundError | None:
    """After a write found nothing to write into: whether the root itself is missing (a
    bucket that does not exist, a directory deleted meanwhile). Then there is no attempt to
    discard or leave for gc, and that, not a key, is what the save's error should name.
    (Asked only on failure: a check before every save would cost a request each.)"""
    try:
        await backend.check_root()
    except NotFoundError as exc:
        return exc
    except CkptStoreError:
        return None
    return None


async def _discard(
    backend: Backend, where: layout.AttemptDir, handoff: Handoff, owner: str
) -> None:
    """Remove the attempt of a save that failed before its commit began, so that what it
    wrote (on a full disk: the space the next save needs) goes at once. Process 0 removes
    it once every process has reported the end of its writes (within `DISCARD_WAIT`
    seconds; a process that never reports may still be writing, so then, as on any error
    here, the attempt is left to `gc`), after claiming its fate (its own commit claim
    counts; one that `gc` won is gc's to remove)."""
    if handoff.me != 0:
        return
    if not await handoff.settled(min(handoff.timeout, DISCARD_WAIT)):
        log.warning("a failed save left attempt %s for gc: not every process reported", where.root)
        return
    try:
        await claim(backend, where, ABANDON, owner)
        removed = await clear_attempt(backend, where, keep_fate=False)
    except FencedError:
        log.info("a failed save's attempt %s is gc's (it decided first)", where.root)
        return
    except Exception as exc:  # the save's own error is the one to raise
        log.warning("a failed save left attempt %s for gc: %s", where.root, exc)
    else:
        log.info("a failed save's attempt %s removed (%d objects)", where.root, removed)


def _last(key: str) -> str:
    return key.rsplit("/", 1)[1]
