"""Saving a tree as one committed checkpoint step.

Protocol (every process runs the same code; see `ckptstore.protocol`):

1. process 0 picks a fresh attempt id and everyone learns it;
2. each process writes its own shards into its own OCDBT store below that
   attempt, with no coordination (process 0 also writes every leaf's metadata),
   meanwhile checks the step is not committed (a committed one fails the save, and
   its attempt is discarded), and reports;
3. process 0 commits through the engine (`ckptstore.checkpoint.engine`): it claims the
   attempt's fate for its commit (a `gc` that decided to collect it first wins, and the
   save fails with `FencedError`), merges the stores by reference in one atomic
   transaction, validates, writes the attempt's manifest and creates the commit marker;
4. everyone returns once process 0 published the outcome (or raises its error).

Nothing outside the attempt is written or deleted, so a concurrent writer of
the same step (a preempted job's zombie, say) can never damage what the other
committed: one marker wins, the loser gets `AlreadyExistsError`.
The hand-offs between these steps are `Handoff` rounds. What a kind of storage adds
to them (tiers: a room check, a host-local fast tier's staging) comes in through
`SaveHooks`, phase by phase; a plain save uses the defaults.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.chunklevel import held_bytes
from ckptstore.checkpoint.declared import Declared
from ckptstore.checkpoint.discard import discard, root_missing
from ckptstore.checkpoint.engine import commit_step
from ckptstore.checkpoint.incremental import SameObjects, Unchanged, unchanged
from ckptstore.checkpoint.saveplan import SavePlan, store_name
from ckptstore.checkpoint.writerrecords import Beside, record
from ckptstore.datapath.arrays import write_store
from ckptstore.datapath.chunkwrites import ChunkPlan
from ckptstore.datapath.packs import PackTarget
from ckptstore.errors import CkptStoreError, ConfigError, NotFoundError
from ckptstore.format import layout
from ckptstore.format.casts import CastPolicy
from ckptstore.format.codecs import CodecPolicy
from ckptstore.format.jsonitems import JsonItem, as_json_item, is_array_tree
from ckptstore.format.leaves import (
    TARGET_CHUNK_BYTES,
    LeafInfo,
    cast_value,
    describe_leaf,
    storable,
)
from ckptstore.format.manifest import Manifest
from ckptstore.format.tree import describe, flatten
from ckptstore.protocol import Attempt, Fate, ensure_uncommitted
from ckptstore.runtime.futures import gather_first_error
from ckptstore.runtime.gcpause import gc_paused
from ckptstore.runtime.handoff import Handoff


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
    #: Payload bytes of the leaves not written because the base step holds them
    #: (an incremental save, ``base=``); 0 otherwise.
    bytes_referenced: int = 0


@dataclass(frozen=True)
class PreparedItem:
    """A tree flattened and described before anything is written (bad leaves fail here)."""

    named: list[tuple[str, Any]]
    leaves: list[LeafInfo]
    structure: dict[str, Any]

    @classmethod
    def of(
        cls,
        tree: Any,
        codecs: CodecPolicy | None = None,
        casts: CastPolicy | None = None,
        chunk_bytes: int = TARGET_CHUNK_BYTES,
    ) -> PreparedItem:
        """``tree`` flattened and described, its big leaves split into chunks of at most
        ``chunk_bytes`` (where a shard divides: `choose_chunks`), the leaves ``casts``
        picks converted to a narrower dtype (None: none), each leaf with the codec
        ``codecs`` picks (None: every leaf raw)."""
        # The collector paused for this short, synchronous step only (see `gcpause`): a
        # full collection here was half of a many-leaf save's time (docs/benchmarks.md).
        with gc_paused():
            named = flatten(tree)
            infos = [describe_leaf(n, v, chunk_bytes) for n, v in named]
            if casts is not None and not casts.empty:
                named, infos = _cast(named, infos, casts, chunk_bytes)
            if codecs is not None:
                infos = codecs.apply(infos)
            if any(info.prng_impl for info in infos):  # typed PRNG keys: write their data
                named = [(n, storable(v)) for n, v in named]
            return cls(named, infos, describe(tree))


def _cast(
    named: list[tuple[str, Any]], infos: list[LeafInfo], casts: CastPolicy, chunk_bytes: int
) -> tuple[list[tuple[str, Any]], list[LeafInfo]]:
    """The leaves ``casts`` picks, converted and described in their stored dtype, each
    recording the dtype it had (`LeafInfo.cast_from`); the others as they are."""
    out_named, out_infos = [], []
    for (name, value), info in zip(named, infos, strict=True):
        target = casts.target_for(info)
        if target is not None:
            value = cast_value(value, target)
            described = describe_leaf(name, value, chunk_bytes)
            info = dataclasses.replace(described, cast_from=info.dtype)
        out_named.append((name, value))
        out_infos.append(info)
    return out_named, out_infos


def prepare(
    step: int,
    items: Mapping[str, Any],
    codecs: Any = None,
    casts: Any = None,
    chunk_bytes: int | None = None,
) -> tuple[int, dict[str, PreparedItem], dict[str, JsonItem]]:
    """Check ``step`` and the item names, and flatten and describe every tree, before
    anything is opened or written. An item that is not arrays and numbers but JSON (a
    dataclass config, a dict with strings) is kept as JSON in the manifest
    (`ckptstore.format.jsonitems`): the third dict. ``codecs``: which leaves are
    compressed, any form `CodecPolicy.of` takes (a bad one fails here too); ``casts``:
    which are stored in a narrower dtype (`CastPolicy.of`: never unless asked);
    ``chunk_bytes``: the largest chunk of a big leaf (default `TARGET_CHUNK_BYTES`);
    smaller chunks let an incremental save write less of a leaf that changed in a few
    places (docs/incremental.md)."""
    step = layout.check_step(step)
    policy, narrower = CodecPolicy.of(codecs), CastPolicy.of(casts)
    if chunk_bytes is None:
        chunk_bytes = TARGET_CHUNK_BYTES
    elif not (isinstance(chunk_bytes, int) and chunk_bytes >= 1):
        raise ConfigError(f"chunk_bytes must be a positive int, not {chunk_bytes!r}")
    if not items:
        raise CkptStoreError("nothing to save: no items")
    prepared: dict[str, PreparedItem] = {}
    configs: dict[str, JsonItem] = {}
    for name, tree in items.items():
        layout.check_item(name)
        if is_array_tree(tree):
            prepared[name] = PreparedItem.of(tree, policy, narrower, chunk_bytes)
        else:
            configs[name] = as_json_item(name, tree)
    return step, prepared, configs


class SaveHooks:
    """What a kind of storage adds to a save, phase by phase (see the module docstring for
    the phases). The defaults are a plain save's; `ckptstore.tiers.save` has the tiers'.

    - phase 1, every process, before the attempt is chosen: `before_attempt` (tiers: is
      the fast tier host-local), then, once the leaves an incremental save references are
      known, `before_write` (tiers: is there room for the others);
    - phase 2, every process: its shards, into packs where `packs` says so, then
      `after_write` (tiers: this host's own copy of what its devices hold);
    - phase 3, process 0: the merge where `merge` says so, then `finish` with the
      manifest and the claimed fate (a plain save commits; a host-local fast tier stages);
    - phase 4, every process: `after_finish` (a host-local fast tier: each process stages
      its part), and the save returns.
    """

    #: Small leaves go into packs (a host-local fast tier's promotion reads OCDBT stores only).
    packs = True
    #: Process 0 merges the stores here (a host-local fast tier: on the durable tier, later).
    merge = True

    async def before_attempt(
        self, backend: Backend, items: dict[str, PreparedItem], step: int, handoff: Handoff
    ) -> None:
        """Before the attempt exists; an error here fails the save with nothing written."""

    async def before_write(
        self,
        backend: Backend,
        items: dict[str, PreparedItem],
        step: int,
        handoff: Handoff,
        same: Unchanged,
    ) -> None:
        """Before the attempt exists, knowing what ``same`` leaves unwritten (an incremental
        save's references); an error here fails the save with nothing written."""

    async def after_write(
        self,
        backend: Backend,
        where: layout.AttemptDir,
        items: dict[str, PreparedItem],
        handoff: Handoff,
    ) -> None:
        """After this process wrote its shards (an error discards the attempt)."""

    async def finish(
        self, attempt: Attempt, manifest: Manifest, fate: Fate, handoff: Handoff
    ) -> None:
        """Process 0, the fate claimed for commit: make the step what readers see."""
        await attempt.commit(manifest, fate)

    async def after_finish(
        self, backend: Backend, where: layout.AttemptDir, handoff: Handoff
    ) -> None:
        """Every process, once process 0 finished; the save returns after this."""


PLAIN = SaveHooks()


@dataclass(frozen=True)
class SaveRequest:
    """One save of prepared items as ``step`` on ``backend``, every process taking part.

    ``hooks``: what the kind of storage adds, phase by phase (`SaveHooks`). With ``base``
    (a committed step), leaves unchanged since it are referenced, not written
    (`ckptstore.checkpoint.incremental`; ``same_objects``, ``base_attempt`` and
    ``changed``: see `unchanged`).
    ``digests`` false: no piece digests are recorded (they cost a hash of every byte
    written), so a later incremental save on this step finds no equal pieces and writes
    every leaf. An incremental save (``base``) always records them."""

    backend: Backend
    items: dict[str, PreparedItem]
    step: int
    timeout: float
    metadata: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)  # earlier phases (staging)
    hooks: SaveHooks = PLAIN
    configs: dict[str, JsonItem] | None = None
    base: int | None = None
    same_objects: SameObjects | None = None
    digests: bool = True
    #: The attempt ``base`` must still be committed as (None: whichever it is).
    base_attempt: str | None = None
    #: Per item, rows of leaves that may differ from ``base`` (`checkpoint.declared`).
    changed: Declared | None = None


@dataclass(frozen=True)
class ProcessReport:
    """What one process wrote in phase 2, as it reports it to process 0."""

    process: int
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    packed: dict[str, int] = field(default_factory=dict)  # per item, leaves it packed
    digested: dict[str, int] = field(default_factory=dict)  # per item, leaves it digested
    chunked: dict[str, int] = field(default_factory=dict)  # per item, leaves with chunk records
    #: Payload bytes of the chunks it left out because the base's holders have them.
    held_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessReport:
        return cls(**data)

    def written(self) -> dict[str, Any]:
        """What the manifest records of it (`Manifest.processes`)."""
        return {
            "process": self.process,
            "shards": self.shards,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
        }


async def save_prepared(request: SaveRequest) -> SaveResult:
    """The save ``request`` describes: the module docstring's protocol, with its hooks'
    additions. Phase 1 (`_references`), the attempt agreed; phase 2 (`_write_mine`); phase
    3 on process 0 (`checkpoint.engine.commit_step` with a `SavePlan`, finished by the
    hooks' `finish`); phase 4."""
    start = time.perf_counter()
    backend, step, hooks = request.backend, request.step, request.hooks
    handoff = Handoff(f"save/{step}", request.timeout)
    await hooks.before_attempt(backend, request.items, step, handoff)
    same = await _references(request, handoff)
    await hooks.before_write(backend, request.items, step, handoff, same)

    async def fresh_attempt() -> str:
        return layout.new_attempt()

    where = layout.AttemptDir(step, await handoff.agree(fresh_attempt))
    attempt = Attempt(backend, where)  # process 0's, the actor its fate record names
    kept: dict[str, Beside] = {}  # process 0's own records, per item (`checkpoint.writerrecords`)

    async def write_mine() -> dict[str, Any]:
        # A committed step is refused (`AlreadyExistsError`) while the writes run, off a
        # small save's critical path (a round trip on object storage): an attempt written
        # in vain is discarded as a failed one is. A manager refused it before staging.
        got = await gather_first_error(
            [_write_mine(request, where, same, handoff.me, kept), ensure_uncommitted(backend, step)]
        )
        report = got[0]
        assert isinstance(report, ProcessReport)
        await hooks.after_write(backend, where, request.items, handoff)
        return report.to_json()

    try:
        mine = ProcessReport.from_json(await handoff.everyone(write_mine))
    except NotFoundError as exc:
        if (missing := await root_missing(backend)) is not None:  # a missing bucket
            raise NotFoundError(
                f"{missing.message}: nothing was saved", backend=backend.url
            ) from exc
        await discard(attempt, handoff)
        raise
    except Exception:
        await discard(attempt, handoff)
        raise
    written = time.perf_counter()
    phases: dict[str, float] = {}
    committing = False  # from the commit (or staging) on, nothing of the attempt is discarded

    async def finish(manifest: Manifest, fate: Fate) -> None:
        nonlocal committing
        phases["merge"] = manifest.timings["merge"]
        committing = True
        await hooks.finish(attempt, manifest, fate, handoff)

    async def merge_and_commit() -> None:
        reports = [ProcessReport.from_json(r) for r in await handoff.reports()]
        plan = SavePlan(request, where, same, reports, kept, written)
        await commit_step(attempt, plan, finish)
        phases["commit"] = time.perf_counter() - written - phases["merge"]

    try:
        await handoff.primary(merge_and_commit)
    except Exception:
        if not committing:
            await discard(attempt, handoff)
        raise
    await hooks.after_finish(backend, where, handoff)
    items = request.items
    return SaveResult(
        step=step,
        attempt=str(where.attempt),
        bytes=sum(info.nbytes for item in items.values() for info in item.leaves),
        bytes_written=mine.bytes,
        seconds=time.perf_counter() - start,
        merge_seconds=phases.get("merge", 0.0),
        timings={"write": written - start, **phases},
        bytes_referenced=mine.held_bytes
        + sum(
            info.nbytes
            for name, item in items.items()
            for info in item.leaves
            if info.name in same.leaves.get(name, set())
        ),
    )


async def _references(request: SaveRequest, handoff: Handoff) -> Unchanged:
    """Phase 1 of an incremental save, every process: the leaves the base step holds
    unchanged (a base gone is typed, nothing written); nothing for a full save."""
    if request.base is None:
        return Unchanged({name: set() for name in request.items}, {})
    pairs = {n: (i.leaves, [v for _, v in i.named]) for n, i in request.items.items()}
    return await unchanged(
        request.backend,
        request.base,
        pairs,
        handoff,
        request.same_objects,
        attempt=request.base_attempt,
        declared=request.changed,
    )


async def _write_mine(
    request: SaveRequest,
    where: layout.AttemptDir,
    same: Unchanged,
    me: int,
    kept: dict[str, Beside],
) -> ProcessReport:
    """Phase 2, every process: its shards of every item into its own store (small leaves
    into packs where the hooks say so), with piece digests where they are recorded; what
    it records beside a store, process 0 keeps in ``kept`` instead (`checkpoint.writerrecords`)."""
    backend = request.backend
    record_digests = request.digests or request.base is not None
    total = ProcessReport(process=me)
    for name, item in request.items.items():
        store = where.process_store(name, me)
        packs = (
            PackTarget(backend, where.item(name), store_name(store))
            if request.hooks.packs
            else None
        )
        skip = same.leaves.get(name, set())
        tables = dict(same.digested.get(name, {})) if record_digests else None
        plan = same.chunks.get(name) or ChunkPlan()
        chunk_plan = ChunkPlan(
            plan.held, dict(plan.digests) if record_digests else {}, plan.declared
        )
        stats = await write_store(
            backend,
            store,
            [
                (info, value)
                for info, (_, value) in zip(item.leaves, item.named, strict=True)
                if info.name not in skip
            ],
            process=me,
            write_metadata=me == 0,
            packs=packs,
            digests=tables,
            chunk_plan=chunk_plan,
        )
        # What the store's writer records beside it, each its own small object: written at once.
        mine = Beside(tables, chunk_plan, stats.packed)
        if me == 0:
            kept[name] = mine
        digested, chunked = await record(backend, store, mine, keep=me == 0)
        total = dataclasses.replace(
            total,
            shards=total.shards + stats.shards,
            bytes=total.bytes + stats.bytes,
            seconds=total.seconds + stats.seconds,
            packed={**total.packed, name: len(stats.packed)},
            digested={**total.digested, name: digested},
            chunked={**total.chunked, name: chunked},
            held_bytes=total.held_bytes + held_bytes(item.leaves, chunk_plan.held),
        )
    return total
