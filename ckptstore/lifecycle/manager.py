"""`CheckpointManager`: checkpoints from a training loop that pause it only for staging.

Most JAX training loops are synchronous and never yield to an event loop, and the next
step often donates the state's buffers. So `CheckpointManager.save` decides (save
policy), copies what the save writes into host memory (`Stager`), and returns a
`SaveHandle`; the write, merge and commit run on the manager's own thread and event
loop, and once the handle is done (the step is committed) the keep policy is applied
there too, before the next save starts. One save is in flight at a time. A background failure is
raised by `SaveHandle.wait` and, if nobody waited for it, by the next `save`.

The class is this module and the parts it holds, one concern each: `Stager` (the copies
a save owns), `Writer` (the write of a staged save on the loop, and the next incremental
save's base), `Retention` (promotion and the keep policy after each step) and `Preemption`
(SIGTERM and JAX's sync point); `OrbaxCompat`, a mixin, adds Orbax's method names (and
reads Orbax roots, never writes them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import sys
import time
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, TypeVar

from ckptstore.api import restore_with
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.incremental import SameObjects
from ckptstore.checkpoint.restore import RestoreOptions
from ckptstore.checkpoint.target import Target, open_target
from ckptstore.errors import CkptStoreError, ConfigError, CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.jsonitems import as_json_item, is_array_tree
from ckptstore.format.manifest import Manifest
from ckptstore.lifecycle import atexit as at_exit
from ckptstore.lifecycle import policies as P
from ckptstore.lifecycle.changes import ChangedRows
from ckptstore.lifecycle.existence import ensure_uncommitted_on
from ckptstore.lifecycle.handles import SaveHandle, SaveStats
from ckptstore.lifecycle.opening import collect_at_start, options_from_profile, refuse_host_local
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.lifecycle.orbaxcompat import OrbaxCompat
from ckptstore.lifecycle.orbaxroot import OrbaxRoot
from ckptstore.lifecycle.preemption import Preemption
from ckptstore.lifecycle.retention import Retention
from ckptstore.lifecycle.staging import Stager
from ckptstore.lifecycle.writing import Writer
from ckptstore.protocol import committed_steps, load_committed
from ckptstore.runtime import distributed
from ckptstore.runtime.blocking import background_loop, run
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.bounded import DURABLE_LIST_SECONDS
from ckptstore.tiers.hostlocal import known_shared
from ckptstore.tiers.offline import StagedSteps, staged_at_start
from ckptstore.tiers.read import read_manifest, steps_now
from ckptstore.tiers.read import restore as tiers_restore
from ckptstore.tiers.target import Tiered, as_tiered, check_distinct

T = TypeVar("T")
log = logging.getLogger("ckptstore")
#: The key of a step's metadata that keeps the save policy's record (`SavePolicy.record`).
POLICY_RECORD = "save_policy"


class CheckpointManager(OrbaxCompat):
    """Saves, keeps and restores the checkpoints of one training run at ``target``.

    ``target`` is anything `ckptstore.save` accepts (None: the profile
    ``$CKPTSTORE_PROFILE`` names); a ``.toml`` profile may carry a ``[manager]`` table
    with the options. Use it as a context manager, or call `close`. Orbax's other names
    (`best_step`, `should_save`, `delete`, `reload`, `metadata`, ...) are `OrbaxCompat`'s.
    """

    def __init__(
        self,
        target: Target | Tiered | None,
        *,
        save_policy: P.SavePolicy | None = None,
        keep_policy: P.KeepPolicy | None = None,
        options: ManagerOptions | None = None,
    ) -> None:
        if options is None:
            options = options_from_profile(target)
        self.options = options
        self.save_policy: P.SavePolicy = save_policy or options.save_policy or P.EveryNSteps(1)
        self.keep_policy: P.KeepPolicy = keep_policy or options.keep_policy or P.KeepAll()
        self._me, self._count = distributed.process_index(), distributed.process_count()
        self._inflight: SaveHandle | None = None
        #: SIGTERM and JAX's preemption sync point (`preempted` asks it).
        self._preemption = Preemption(
            self._count,
            timeout=options.timeout,
            inflight=lambda: self._inflight,
            shutdown=self._shutdown,
        )
        #: With a `Tiered` target (or a profile with a [tiers] table), saves go to the fast
        #: tier and each committed step is promoted to the durable one in the background.
        #: With ``incremental=True`` each save references the last committed step on the
        #: fast tier, and promotion copies what a step references once (`tiers.holders`).
        self.tiered = as_tiered(target)
        fast = self.tiered.fast if self.tiered is not None else target
        assert not isinstance(fast, Tiered)
        self._owns_backend = not isinstance(fast, Backend)
        self.backend = open_target(fast)  # bad targets fail here, before any thread starts
        self.durable: Backend | None = None
        if self.tiered is not None:
            self.durable = open_target(self.tiered.durable)
            check_distinct(self.backend, self.durable)  # before anything is written
        self._loop = background_loop()  # the `_sync` twins' loop thread (`runtime.blocking`)
        self._open = True
        self._stager = Stager(max_bytes=options.max_staging_bytes)
        self._changes = ChangedRows()  # rows declared changed, call by call (`changed=`)
        self._warmed = False  # whether the stager was given a state to compile for
        self._last_time: float | None = None
        self._records: dict[int, P.StepRecord] = {}
        self.stats: list[SaveStats] = []  # every save this manager committed, in order
        #: An Orbax `CheckpointManager` root at the target (no steps when a ckptstore step
        #: is committed there): read like ckptstore's, never written.
        self._orbax = OrbaxRoot(self.backend, self.durable, options.timeout)
        #: Host-local fast tiers with several processes: the newest step staged on every
        #: host that the durable tier does not list (yet), with its manifest, read from the
        #: hosts' own copies (`tiers.offline`); until its promotion.
        self._staged: dict[int, Manifest] = {}
        try:
            committed, staged = self._open_steps()
            self._hold_parts(committed, staged)
        except BaseException:
            self._shutdown()
            raise
        if options.handle_sigterm:
            self._preemption.install()
        at_exit.track(self)  # a script that never closes it still commits its last save

    def _open_steps(self) -> tuple[list[int], StagedSteps]:
        """What the target holds at start: the committed steps (and a host-local fast
        tier's staged ones: `_staged`), or an Orbax root's (then every save is refused)."""
        staged = StagedSteps()
        if self.durable is not None:
            staged = self._call(staged_at_start(self.backend, self.durable, self.options.timeout))
            if staged.newest is not None:
                self._staged[staged.newest.step] = staged.newest
        committed = self._call(self._committed_steps())
        self._call(self._orbax.look(committed))
        if self._orbax.refusal is not None:  # said now: a job learns it at start
            log.warning(
                "ckptstore: %s; every save() raises UnsupportedOperationError",
                self._orbax.refusal,
            )
        steps = committed or self._orbax.steps
        self._last_step: int | None = steps[-1] if steps else None
        return committed, staged

    def _hold_parts(self, committed: list[int], staged: StagedSteps) -> None:
        """The parts that save and keep, given what `_open_steps` found; the start-up work
        (gc, resumed promotions) queued on the manager's loop: the constructor only opens."""
        options = self.options
        base = committed[-1] if committed else None  # on tiers: the fast tier's last
        if self.durable is not None and committed:
            on_fast = self._call(committed_steps(self.backend))
            base = on_fast[-1] if on_fast else None
        if options.incremental and self.tiered is not None and self._count > 1:
            self._call(refuse_host_local(self.backend, self._count, options.timeout))
        if self.save_policy.remembers:  # a restarted job's policy carries on
            self.save_policy.resume(self._policy_record(committed))
        #: Promotion and the keep policy after each save (`lifecycle.retention`).
        self._retention = Retention(
            self._target(),
            self.keep_policy,
            options,
            self._count,
            self._records,
            self._staged,
            staged.waiting,
        )
        #: The write of each staged save, and the next incremental save's base.
        self._writer = Writer(
            self._target(), options, self.stats, self._records, self._retention, self._loop, base
        )
        collect = options.gc_on_start and self._me == 0
        resume = self.durable is not None and self.tiered is not None and bool(committed)
        if collect or resume:
            self._retention.start(self._start(collect, resume), self._loop)

    async def _start(self, collect: bool, resume: bool) -> None:
        """In the background, at start: the `gc` of the target (the fast tier; process 0),
        then the promotion of what a predecessor left unpromoted (every process). Either's
        failure surfaces like a keep policy's: at the next `save` or `wait_until_finished`."""
        if collect:
            await collect_at_start(self.backend, self.options.gc_grace)
        if resume:
            await self._retention.resume()

    @property
    def preempted(self) -> bool:
        """Whether the job is being preempted, so the loop should stop once this step is
        saved: this process got SIGTERM (one process), or every process reached JAX's
        preemption sync point at the same step (several; `save` must then be called at
        every step, as the sync point is one step that every process must pass through).
        A loop that reads it stops by itself; one that never does exits at the next `save`
        (`ckptstore.lifecycle.preemption`).

        It turns true at a `save` call (the one the policy's `OnPreemption` saves), never
        between two: a SIGTERM that lands after this step's `save` call and before the loop
        reads this is seen by the next call, so ``save(step); if mgr.preempted: break``
        never stops the loop on a step that was not saved."""
        return self._preemption.preempted

    @property
    def unpromoted(self) -> set[int]:
        """Steps committed on the fast tier while the durable tier was down, promoted at
        the next save's turn once it answers (`lifecycle.retention`)."""
        return self._retention.unpromoted

    @property
    def resumed_promotions(self) -> list[int]:
        """Steps a predecessor (killed, or never closed) left unpromoted, promoted by this
        manager in the background before its first save's."""
        return self._retention.resumed

    # ---- saving ----

    def save(
        self,
        step: int,
        state: Any = None,
        *,
        items: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
        changed: Mapping[str, Any] | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` (or several named ``items``) as ``step`` if the save policy says so.

        Returns None when it does not, else once every piece is staged in host memory:
        the caller may then donate, delete or change the arrays. ``metrics`` are kept with
        the step (for `KeepBest`). Raises an earlier background failure nobody waited for,
        and `AlreadyExistsError` (before staging anything) when ``step`` is committed.

        ``changed`` (incremental managers): ``{leaf: rows}`` (with ``items``: ``{item:
        {leaf: rows}}``), the rows this step's update touched, given on every call, saving
        or not: a save hashes only the chunks holding the rows named since its base
        (`ckptstore.lifecycle.changes`; docs/incremental.md, "Declared changes").
        """
        step = layout.check_step(step)
        self._preemption.exit_unless_heeded()  # a SIGTERM the loop did not stop for
        self._orbax.refuse()  # whatever the policy would say: the job learns it now
        trees = _items(state, items, self.options.item)
        if changed is not None and not self.options.incremental:
            raise ConfigError("changed= needs an incremental manager (incremental=True)")
        self._changes.add(changed, None if items is not None else self.options.item, trees)
        self._raise_unobserved()
        start = time.perf_counter()
        if not self._decide(step, force):
            if not self.stats and not self._warmed:  # once, before the first save: then
                self._warmed = True  # its device copy is compiled, as the later ones'
                arrays = {n: v for n, v in trees.items() if is_array_tree(v)}  # as `stage`'s
                self._stager.warm(arrays, self.options.staging)
            return None
        before = time.perf_counter()
        self._settle()  # the previous save: its errors surface here, unless already seen
        waited = time.perf_counter() - before
        # A committed step is refused here, before anything is staged, as `save_sync` does;
        # the write would only fail later, at `wait()` or the next save.
        self._call(ensure_uncommitted_on(self.backend, self.durable, step, self.options.timeout))
        if self._last_step is not None and step < self._last_step:
            log.warning(
                "ckptstore: saving step %d after step %d: latest_step() and restore() with "
                "no step give the highest committed step, not this one",
                step,
                self._last_step,
            )
        # Host-local fast tiers (or not known yet): each host also keeps what else its
        # devices hold, to serve a restart alone (`hostlocal`); that is staged too.
        host_view = (
            self.tiered is not None
            and self._count > 1
            and known_shared(self.backend, self._count) is not True
        )
        # Configuration items (a dataclass, a dict with strings) become JSON now, a copy.
        configs = {n: as_json_item(n, v) for n, v in trees.items() if not is_array_tree(v)}
        arrays = {n: v for n, v in trees.items() if n not in configs}
        same, objects = self._writer.same_objects(arrays) if self.options.incremental else ({}, {})
        base = self._writer.base if self.options.incremental else None
        pinned = self._writer.base_attempt is not None  # the base is a step this manager saved
        declared = self._changes.for_save(step, base, pinned)
        # An incremental save reads its pieces twice (digests, then the write): device
        # copies stay until the save ends instead of going as each piece is written.
        staged = self._stager.stage(
            arrays, self.options.staging, host_view=host_view, drain=not self.options.incremental
        )
        self._last_step, self._last_time = step, time.monotonic()
        pin = self._writer.base_attempt if same or declared else None  # what both are relative to
        vouched = SameObjects(pin, same) if pin else None
        future = asyncio.run_coroutine_threadsafe(
            self._writer.write(
                step,
                staged,
                configs,
                dict(metrics or {}),
                self._with_policy_record(dict(metadata or {})),
                start,
                waited,
                base,
                vouched,
                objects,
                declared,
            ),
            self._loop,
        )
        self._inflight = SaveHandle(step, future)
        return self._inflight

    def _policy_record(self, committed: list[int]) -> Any:
        """The save policy's record kept with the latest committed step (None: none, or
        that step cannot be read: the policy starts afresh, and restore will say why)."""
        try:
            return self._metadata(committed[-1]).get(POLICY_RECORD) if committed else None
        except CorruptCheckpointError as exc:
            log.warning("ckptstore: the save policy starts afresh: %s", exc)
            return None

    def _with_policy_record(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """``metadata`` and the save policy's record, which a restarted job resumes from."""
        if self.save_policy.remembers:
            metadata[POLICY_RECORD] = self.save_policy.record()
        return metadata

    def _decide(self, step: int, force: bool) -> bool:
        wanted, go = self._policy_says(step, force)
        agreed_alone = force or (self.save_policy.deterministic and self.options.if_busy == "wait")
        if self._count > 1 and not agreed_alone:  # clocks and progress differ: process 0 decides
            go = self._call(self._agree(step, go))
        if wanted and not go:
            log.warning("ckptstore: skipped saving step %d: the previous save is running", step)
        return go

    def _policy_says(self, step: int, force: bool) -> tuple[bool, bool]:
        """(whether the policy wants ``step``, whether this process would save it now),
        from this process's view alone; nothing changes but the preemption flag, which
        follows the signal or JAX's sync point."""
        busy = self._inflight is not None and not self._inflight.done()
        preempted = self._preemption.check(step)
        ctx = P.SaveContext(
            step=step,
            now=time.monotonic(),
            last_step=self._last_step,
            last_time=self._last_time,
            in_flight=busy,
            preempted=preempted,
        )
        wanted = force or self.save_policy.should_save(ctx)
        # A preemption's save is never skipped: it waits for the one in flight.
        go = wanted and not (busy and self.options.if_busy == "skip" and not preempted)
        return wanted, go

    async def _agree(self, step: int, go: bool) -> bool:
        handoff = Handoff(f"manager/decide/{step}", self.options.timeout)

        async def decide() -> str:
            return "save" if go else "skip"

        return await handoff.agree(decide) == "save"

    def _target(self) -> Backend | Tiered:
        """Where saves, promotions and deletes go: the open backend, or on tiers both open
        tiers with the target's settings (``keep_fast``, the free margin)."""
        if self.durable is not None and self.tiered is not None:
            return dataclasses.replace(self.tiered, fast=self.backend, durable=self.durable)
        return self.backend

    def wait_until_finished(self) -> None:
        """Block until the save in flight (if any) is committed and the keep policy applied;
        raises what either raised."""
        if self._inflight is not None:
            self._inflight.wait()
        retention = self._retention.take()
        if retention is not None:
            retention.result()

    def _settle(self) -> None:
        """Wait for the save in flight; raise its error, or the keep policy's, if unseen."""
        if self._inflight is not None:
            if self._inflight.observed:
                concurrent.futures.wait([self._inflight._future])
            else:
                self._inflight.wait()
        self._retention.raise_error()

    def _raise_unobserved(self) -> None:
        handle = self._inflight
        if handle is not None and handle.done() and not handle.observed:
            handle.wait()  # raises the failure, once

    # ---- reading ----

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps (on either tier), ascending; as `ckptstore.list_steps`, where
        none is committed, the finalized steps of an Orbax `CheckpointManager` root."""
        return self._call(self._all_steps())

    async def _all_steps(self) -> list[int]:
        return await self._committed_steps() or await self._orbax.finalized_steps()

    async def _committed_steps(self) -> list[int]:
        if self.durable is None:
            return await committed_steps(self.backend)
        return await steps_now(self.backend, self.durable, self._staged, self.options.timeout)

    def _restore(self, step: int | None, like: Any, options: RestoreOptions) -> Any:
        """From the target, or from the nearest tier with a good copy (`tiers.read`)."""
        if self.durable is None:
            return self._call(restore_with(self.backend, step, like, options))
        if step is None:  # the steps this manager lists (staged ones, an outage's)
            step = self.latest_step()
        staged = self._staged.get(step) if step is not None else None
        tiers = Tiered(self.backend, self.durable)
        return self._call(tiers_restore(tiers, step, like, options, staged))

    def restore(
        self,
        step: int | None = None,
        like: Any = None,
        *,
        item: str | None = None,
        items: Mapping[str, Any] | None = None,
        partial: bool = False,
        cast: bool = False,
    ) -> Any:
        """Restore ``step`` (the latest committed by default), like `ckptstore.restore`.

        ``items`` maps item names to their ``like`` (None for the saved tree) and returns a
        dict of the restored items, all from the same step.
        """
        options = RestoreOptions(item=item or self.options.item, partial=partial, cast=cast)
        if items is None:
            return self._restore(step, like, options)
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CkptStoreError(f"no committed checkpoint in {self.backend.url}")
        return {
            name: self._restore(step, item_like, dataclasses.replace(options, item=name))
            for name, item_like in items.items()
        }

    def _metadata(self, step: int) -> dict[str, Any]:
        """The metadata committed ``step`` was saved with (on tiers: from the nearest good
        copy, as `restore` reads it: `tiers.read`)."""
        if self.durable is None:
            return self._call(load_committed(self.backend, step)).metadata
        tiers = Tiered(self.backend, self.durable)
        return self._call(read_manifest(tiers, step, self._staged.get(step))).metadata

    # ---- life cycle ----

    def close(self) -> None:
        """Wait for the save in flight, then release everything (its error, if unseen, raises).
        Steps left unpromoted while the durable tier was down are promoted now if it answers
        (else the next manager on these tiers, or ``ckptstore promote``, promotes them)."""
        try:
            self._settle()
            retention = self._retention.take()
            if retention is not None:
                retention.result()
            if self.unpromoted and self.tiered is not None:
                seconds = min(self.options.timeout, DURABLE_LIST_SECONDS)
                self._call(self._retention.catch_up(seconds))
        finally:
            self._shutdown()

    def finish_at_exit(self) -> str | None:
        """At interpreter exit, for a manager never closed (`lifecycle.atexit`): wait for
        the save in flight and the keep policy, up to ``options.timeout``; what went wrong."""
        handle, timeout = self._inflight, self.options.timeout
        step = handle.step if handle is not None else None
        try:
            if handle is not None and not handle.done():
                print(
                    f"ckptstore: finishing the save of step {step} before exit "
                    "(the CheckpointManager was not closed)",
                    file=sys.stderr,
                    flush=True,
                )
                handle.wait(timeout)
            if self._retention.future is not None:
                self._retention.future.result(timeout)
        except concurrent.futures.TimeoutError:
            return f"step {step} was not committed within {timeout:.0f} s of exit; it is lost"
        except Exception as exc:
            if handle is not None and handle.observed:
                return None  # its error was seen by the caller already
            return f"the save of step {step} failed at exit: {exc}"
        return None

    def _shutdown(self) -> None:
        at_exit.untrack(self)
        self._preemption.uninstall()
        if self._open:  # the loop is shared: only what this manager opened closes
            self._open = False
            if self._owns_backend:
                self._call(self.backend.close())
            if self.durable is not None and self.tiered is not None:
                if not isinstance(self.tiered.durable, Backend):
                    self._call(self.durable.close())
        self._stager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> CheckpointManager:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.close)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop and wait for it (Ctrl-C cancels it and
        waits until it stopped, as in the `_sync` twins)."""
        return run(coro)


def _items(state: Any, items: Mapping[str, Any] | None, default: str) -> dict[str, Any]:
    if (state is None) == (items is None):
        raise CkptStoreError("pass the state, or items={name: tree, ...}, not both")
    trees = dict(items) if items is not None else {default: state}
    for name in trees:
        layout.check_item(name)  # refused before anything is staged
    return trees
