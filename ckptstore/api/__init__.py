"""The public operations, each defined once: the one place that tells a target's kind
(one backend; a `Tiered` pair, or a profile with a ``[tiers]`` table; an Orbax checkpoint
where no ckptstore step is) and hands it to the folder that owns it: `ckptstore.checkpoint`
(one backend), `ckptstore.tiers`, `ckptstore.orbax` (an Orbax root read in place; the
Orbax import and export are in `ckptstore.api.orbax`). Each async operation has its
blocking ``_sync`` twin right below it, with the same signature (`ckptstore.runtime.blocking`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint import cleanup
from ckptstore.checkpoint import restore as plain
from ckptstore.checkpoint import save as plain_save
from ckptstore.checkpoint import verify as plain_verify
from ckptstore.checkpoint.cleanup import Removal
from ckptstore.checkpoint.declared import declared_rows
from ckptstore.checkpoint.incremental import SameObjects
from ckptstore.checkpoint.partial import PartialSave
from ckptstore.checkpoint.parts import Part
from ckptstore.checkpoint.restore import RestoreOptions
from ckptstore.checkpoint.save import SaveResult
from ckptstore.checkpoint.storeditem import StoredItem
from ckptstore.checkpoint.target import Target, opened
from ckptstore.checkpoint.verify import VerifyReport
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.format import layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import Manifest
from ckptstore.orbax import read as orbax_read
from ckptstore.orbax import steps as orbax_steps
from ckptstore.protocol import committed_steps, latest_manifest, resolve_step
from ckptstore.runtime import distributed
from ckptstore.runtime.blocking import blocking, run
from ckptstore.tiers import cleanup as tier_cleanup
from ckptstore.tiers import read as tier_read
from ckptstore.tiers import save as tier_save
from ckptstore.tiers.promote import Promotion as Promotion
from ckptstore.tiers.promote import promote as promote
from ckptstore.tiers.target import AnyTarget, as_tiered, single

# ---- saving ----


async def save(
    target: AnyTarget,
    tree: Any,
    *,
    step: int,
    item: str = layout.DEFAULT_ITEM,
    metadata: dict[str, Any] | None = None,
    timeout: float = distributed.DEFAULT_TIMEOUT,
    base: int | SaveResult | None = None,
    changed: Mapping[str, Any] | None = None,
    codecs: Any = None,
    casts: Any = None,
    chunk_bytes: int | None = None,
) -> SaveResult:
    """Save ``tree`` as checkpoint ``step``; returns once it is committed.

    ``codecs``: which leaves are compressed (docs/codecs.md): None (the default: none),
    one codec for every leaf (``ckptstore.Zstd(3)``, ``"zstd:3"``), ``{pattern: codec}``
    (glob patterns on leaf names, first match wins) or a callable ``(name, info) ->
    codec``; a bad one is `ConfigError` before anything is written. ``casts``: lossy,
    only where asked: ``{pattern: dtype}`` (or a callable) stores matching floating-point
    leaves in a narrower dtype (``"bfloat16"``...), restored into the dtype they had
    (docs/codecs.md, "Lossy casts").

    ``base`` (a committed step): an incremental save. Each leaf whose content equals what
    ``base`` stored (same shape, dtype, chunking, pieces and 128-bit digests) is
    referenced, not written; restore, verify, `delete_step`, `gc` and `promote` follow
    and keep the reference (docs/incremental.md). `BaseStepGoneError` (a
    `CheckpointNotFoundError`) if ``base`` is not committed (on tiers: on the fast tier),
    before anything is written, or no longer committed when the save would commit (then
    nothing is committed). Host-local fast tiers of a multi-host job refuse it
    (`UnsupportedOperationError`). A leaf of several chunks that changed in some of them
    is written in part: only its changed chunks (docs/incremental.md, "Chunk references").
    ``base`` may be the `SaveResult` of the save that made it: then that attempt must
    still be the one committed (`BaseStepGoneError` if the step was saved again since).

    ``changed`` (with ``base``): ``{leaf name: row indices}``, the only rows (first axis)
    of those leaves that may differ from ``base``, as a sparse optimizer knows them: only
    the chunks holding them are read and hashed, the rest referenced unread. Trusted: an
    undeclared change is not saved (docs/incremental.md, "Declared changes"). Leaves not
    named are compared as ever; a bad declaration is `ConfigError` before any write.

    ``chunk_bytes``: the largest chunk of a big leaf (default 64 MiB; chunks divide each
    shard). Smaller chunks let incremental saves of sparsely updated leaves (embedding
    tables) write less; a base is used chunk by chunk only with the same chunk shape.

    On a `Tiered` target (or a profile with a ``[tiers]`` table) the step is saved and
    committed on the fast tier, after checking it has room; promotion to the durable tier
    is separate (`promote`, the manager, ``ckptstore promote``). Raises
    `AlreadyExistsError` if ``step`` is already committed (on the fast tier, for tiers).
    """
    return await save_items(
        target,
        {item: tree},
        step=step,
        metadata=metadata,
        timeout=timeout,
        base=base,
        changed=None if changed is None else {item: changed},
        codecs=codecs,
        casts=casts,
        chunk_bytes=chunk_bytes,
    )


save_sync = blocking(save)


async def save_items(
    target: AnyTarget,
    items: Mapping[str, Any],
    *,
    step: int,
    metadata: dict[str, Any] | None = None,
    timeout: float = distributed.DEFAULT_TIMEOUT,
    timings: dict[str, float] | None = None,
    base: int | SaveResult | None = None,
    changed: Mapping[str, Mapping[str, Any]] | None = None,
    same_objects: SameObjects | None = None,
    digests: bool = True,
    codecs: Any = None,
    casts: Any = None,
    chunk_bytes: int | None = None,
) -> SaveResult:
    """Save several trees (items, e.g. the train state and a data-iterator state) as one
    step, committed together; restore reads any of them by name. An item that is not
    arrays and numbers but JSON (a dataclass config, a dict with strings) is kept as JSON
    in the manifest and restored as JSON (or into the dataclass ``like`` gives).
    ``same_objects`` (with ``base``; the manager's): per item, leaves that are the very
    `jax.Array` objects the caller saved as ``base``'s attempt, so not digested again (a
    ``base`` committed since as another attempt is `BaseStepGoneError`). ``digests`` false
    (a manager that does not save incrementally): no piece digests are recorded, so an
    incremental save on this step later writes every leaf; with ``base`` they always are.
    ``codecs``, ``casts``, ``chunk_bytes``, ``base``: as `save`'s, for every item;
    ``changed``: as `save`'s, per item (``{item: {leaf: rows}}``)."""
    step, prepared, configs = plain_save.prepare(step, items, codecs, casts, chunk_bytes)
    base, attempt = (base.step, base.attempt) if isinstance(base, SaveResult) else (base, None)
    if base is not None:
        base = layout.check_step(base)
    declared = None
    if changed is not None:  # checked against the leaves before anything is opened
        shapes = {n: {i.name: i.shape for i in p.leaves} for n, p in prepared.items()}
        declared = declared_rows(shapes, changed, base)

    def request(
        backend: Backend, hooks: plain_save.SaveHooks = plain_save.PLAIN
    ) -> plain_save.SaveRequest:
        return plain_save.SaveRequest(
            backend,
            prepared,
            step,
            timeout,
            metadata=metadata,
            timings=timings or {},
            hooks=hooks,
            configs=configs,
            base=base,
            same_objects=same_objects,
            digests=digests,
            base_attempt=attempt,
            changed=declared,
        )

    tiers = as_tiered(target)
    if tiers is not None:  # committed (or staged, on host-local fast tiers) on the fast tier
        async with tiers.opened() as (fast, durable):
            hooks = tier_save.hooks(tiers, durable, incremental=base is not None)
            return await plain_save.save_prepared(request(fast, hooks))
    async with opened(single(target)) as backend:
        return await plain_save.save_prepared(request(backend))


async def partial_save(
    target: AnyTarget,
    step: int,
    *,
    item: str = layout.DEFAULT_ITEM,
    timeout: float = distributed.DEFAULT_TIMEOUT,
    resume: bool = True,
    attempt: str | None = None,
    base: int | None = None,
) -> PartialSave:
    """Open (or resume) a partial-save session for ``step``: see `PartialSave.open`.
    With ``base`` (a committed step) the session is incremental: each part references
    the leaves unchanged since ``base`` rather than write them (docs/incremental.md).

    On a `Tiered` target the session lives on the fast tier (no free-space check: parts
    come one at a time, their total is unknown up front); promote the step afterwards.
    A multi-process session on host-local fast tiers is refused with
    `UnsupportedOperationError`."""
    tiers = as_tiered(target)
    backend, release = await _open_until_released(single(target) if tiers is None else tiers.fast)
    try:
        if tiers is not None:
            await tier_save.refuse_host_local(backend, layout.check_step(step), timeout)
    except BaseException:
        await release()
        raise
    return await PartialSave.open(  # closing the session (or failing to open it) releases
        backend,
        step,
        item=item,
        timeout=timeout,
        resume=resume,
        attempt=attempt,
        base=base,
        release=release,
    )


async def _open_until_released(target: Target) -> tuple[Backend, Callable[[], Awaitable[None]]]:
    """``target``'s backend, open until the returned function is called (a session that
    outlives this call owns it)."""
    owner = opened(target)
    backend = await owner.__aenter__()

    async def release() -> None:
        await owner.__aexit__(None, None, None)

    return backend, release


class PartialSaveSync:
    """A `PartialSave` session with blocking methods (``with`` closes it, as ``async with``
    closes the async one)."""

    def __init__(self, session: PartialSave):
        self.session = session

    @property
    def step(self) -> int:
        return self.session.step

    @property
    def attempt(self) -> str:
        """See `PartialSave.attempt`."""
        return self.session.attempt

    @property
    def parts(self) -> list[Part]:
        """The parts recorded so far."""
        return self.session.parts

    @property
    def leaves(self) -> dict[str, LeafInfo]:
        """See `PartialSave.leaves`."""
        return self.session.leaves

    def leaves_of(self, item: str) -> dict[str, LeafInfo]:
        """See `PartialSave.leaves_of`."""
        return self.session.leaves_of(item)

    def add(
        self,
        subtree: Any,
        *,
        replace: bool = False,
        item: str | None = None,
        codecs: Any = None,
        casts: Any = None,
    ) -> Part:
        """`PartialSave.add`, blocking."""
        return run(
            self.session.add(subtree, replace=replace, item=item, codecs=codecs, casts=casts)
        )

    def drop(self, index: int) -> None:
        """`PartialSave.drop`, blocking."""
        run(self.session.drop(index))

    def abandon(self) -> None:
        """`PartialSave.abandon`, blocking."""
        run(self.session.abandon())

    def finalize(
        self,
        *,
        metadata: dict[str, Any] | None = None,
        structure: dict[str, Any] | None = None,
        structures: Mapping[str, dict[str, Any]] | None = None,
        json_items: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """`PartialSave.finalize`, blocking."""
        return run(
            self.session.finalize(
                metadata=metadata, structure=structure, structures=structures, json_items=json_items
            )
        )

    def close(self) -> None:
        """`PartialSave.close`, blocking."""
        run(self.session.close())

    def __enter__(self) -> PartialSaveSync:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PartialSaveSync step {self.step} attempt {self.attempt}>"


#: A session whose methods block (`PartialSaveSync`).
partial_save_sync = blocking(partial_save, PartialSaveSync)

#: `promote`'s twin (`promote` and `Promotion` are `ckptstore.tiers.promote`'s).
promote_sync = blocking(promote)

# ---- reading ----


async def list_steps(target: AnyTarget) -> list[int]:
    """Committed steps, ascending; steps without a commit marker are ignored.

    On tiers, those committed on either tier. Where a single target has no committed
    step, the finalized steps of an Orbax `CheckpointManager` root there (never its
    temporary directories).
    """
    tiers = as_tiered(target)
    if tiers is not None:
        return await tier_read.list_steps(tiers)
    async with opened(single(target)) as backend:
        return await committed_steps(backend) or await orbax_steps.finalized_steps(backend)


list_steps_sync = blocking(list_steps)


async def read_manifest(target: AnyTarget, step: int | None = None) -> Manifest:
    """The verified manifest of a committed step (the latest when ``step`` is None); on
    tiers, from the nearest tier with a good copy."""
    tiers = as_tiered(target)
    if tiers is not None:
        return await tier_read.read_manifest(tiers, step)
    async with opened(single(target)) as backend:
        return await latest_manifest(backend, step)


read_manifest_sync = blocking(read_manifest)


async def restore(
    target: AnyTarget,
    step: int | None = None,
    like: Any = None,
    *,
    item: str = layout.DEFAULT_ITEM,
    partial: bool = False,
    cast: bool = False,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
) -> Any:
    """Restore a committed step (the latest by default).

    ``like`` describes what to build: ``None`` gives the saved tree with numpy arrays
    (typed PRNG keys as typed keys of their saved implementation); a tree of
    `jax.ShapeDtypeStruct` (or arrays) with shardings gives jax arrays laid out that way,
    each process reading only its slices. ``item``: which item of the step. ``partial``:
    leaves stored but not in ``like`` are allowed. ``cast``: leaves may be cast to
    ``like``'s dtypes. At most ``max_inflight_bytes`` of read data wait for their devices
    at a time (one slice larger than that is read alone).

    On tiers, the step is read from the nearest tier with a good copy. Where a single
    target has no such committed step but holds an Orbax checkpoint (a
    `StandardCheckpointer` directory, or a `CheckpointManager` root with a finalized
    ``step``), that is read instead, with the same semantics.
    """
    options = RestoreOptions(
        item=item, partial=partial, cast=cast, max_inflight_bytes=max_inflight_bytes
    )
    return await restore_with(target, step, like, options)


restore_sync = blocking(restore)


async def restore_with(
    target: AnyTarget, step: int | None, like: Any, options: RestoreOptions
) -> Any:
    """`restore` with its keywords gathered in ``options`` (`CheckpointManager.restore`
    builds them once too): the one place a restore tells tiers from one backend, and opens
    the backend."""
    tiers = as_tiered(target)
    if tiers is not None:
        return await tier_read.restore(tiers, step, like, options)
    async with opened(single(target)) as backend:  # each step below pauses the collector
        stored = await _stored_or_orbax(backend, step, options.item)
        return await plain.restore_item(stored, like, options)


async def _stored_or_orbax(backend: Backend, step: int | None, item: str) -> StoredItem | JsonItem:
    """The item to restore: of a committed ckptstore step, else of an Orbax checkpoint."""
    try:
        return await plain.open_stored(backend, step, item)
    except CheckpointNotFoundError:
        where = await orbax_steps.locate(backend, step)
        if where is None:
            raise
        return await orbax_read.open_item(backend, where, item, default_item=layout.DEFAULT_ITEM)


async def verify(
    target: AnyTarget,
    step: int | None = None,
    *,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    progress: plain_verify.ProgressFn | None = None,
) -> VerifyReport:
    """Check committed ``step`` (the latest by default) end to end; never raises for damage
    (`CheckpointNotFoundError` only if there is no such committed step).
    ``progress(bytes_done, bytes_total)`` is called as data is read and checked.

    On tiers: the copy a restore would read. A damaged fast copy is reported in
    ``skipped`` (and logged) and the durable copy is checked instead, if it has the step.
    """
    tiers = as_tiered(target)
    if tiers is not None:
        return await tier_read.verify(
            tiers, step, max_inflight_bytes=max_inflight_bytes, progress=progress
        )
    async with opened(single(target)) as backend:
        at = await resolve_step(backend, step)
        return await plain_verify.verify_step(
            backend, at, max_inflight_bytes=max_inflight_bytes, progress=progress
        )


verify_sync = blocking(verify)

# ---- removing ----


async def delete_step(target: AnyTarget, step: int) -> Removal:
    """Delete committed ``step``: its marker first, then the attempt it named.

    The attempt's data stays if another committed attempt references it. A step whose
    marker is unreadable loses just the marker; `gc` removes the rest. On a `Tiered`
    target the step leaves both tiers, the fast one first (killed in between, the
    durable copy is still listed: never a fast-only step that a later promotion would
    bring back). Entries are then named by URL.
    """
    tiers = as_tiered(target)
    if tiers is not None:
        return await tier_cleanup.delete_step(tiers, step)
    step = layout.check_step(step)
    async with opened(single(target)) as backend:
        return await cleanup.remove_step(backend, step)


delete_step_sync = blocking(delete_step)


async def gc(
    target: AnyTarget, *, older_than: float = cleanup.DEFAULT_GRACE, dry_run: bool = False
) -> Removal:
    """Remove uncommitted attempts and unused parts nobody wrote to for ``older_than`` s.

    ``older_than=0`` collects regardless of age (only when no writer can be running).
    Where a backend cannot tell when an object was written, it is never collected
    unless ``older_than`` is 0. On a `Tiered` target both tiers are collected (an
    interrupted promotion's objects are garbage of the durable tier until its marker
    lands: the grace period keeps a running one's); entries are then named by URL.
    """
    tiers = as_tiered(target)
    if tiers is not None:
        return await tier_cleanup.gc(tiers, older_than=older_than, dry_run=dry_run)
    cleanup.check_grace(older_than)
    async with opened(single(target)) as backend:
        return await cleanup.collect(backend, older_than, dry_run)


gc_sync = blocking(gc)
