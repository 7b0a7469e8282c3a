"""The write of a staged save, on `CheckpointManager`'s loop (the `Writer` it holds):
`save_items` from the copy staged in host memory, saved again in full, once, if its base
step is gone; then the step's record, its `SaveStats` and the keep policy queued after it.
For incremental saves it also keeps what the next save references: the base step, the
attempt it is, and the arrays it was saved from (`Writer.same_objects`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from ckptstore.api import save_items
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.declared import Declared
from ckptstore.checkpoint.incremental import SameObjects
from ckptstore.checkpoint.save import SaveResult
from ckptstore.datapath.arrays import may_share_host_memory
from ckptstore.errors import BaseStepGoneError
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.tree import flatten
from ckptstore.lifecycle import policies as P
from ckptstore.lifecycle.handles import SaveStats
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.lifecycle.staging import Staged
from ckptstore.tiers.target import Tiered

if TYPE_CHECKING:
    from ckptstore.lifecycle.retention import Retention

log = logging.getLogger("ckptstore")


class Writer:
    """The background half of a manager's saves, and the next save's base (see the module
    docstring): saves to ``target`` (the open backend, or both open tiers) with ``options``;
    each committed step's `SaveStats` appended to ``stats`` and its record to ``records``
    (the manager's, shared), then its turn queued on ``retention``, on ``loop``. ``base``:
    the base of the first incremental save (the last step committed at start)."""

    def __init__(
        self,
        target: Backend | Tiered,
        options: ManagerOptions,
        stats: list[SaveStats],
        records: dict[int, P.StepRecord],
        retention: Retention,
        loop: asyncio.AbstractEventLoop,
        base: int | None,
    ) -> None:
        self.target, self.options, self.stats = target, options, stats
        self._records, self._retention, self._loop = records, retention, loop
        #: The base of the next incremental save: the last step committed (an Orbax step
        #: never is one). Set on the loop thread once a save commits; read by `save` after
        #: `_settle`, so after that save's future completed. On tiers, the last committed
        #: on the fast tier: the save reads its base there.
        self.base = base
        #: The attempt this manager saved ``base`` as (None: found on disk): only that
        #: attempt holds what ``objects`` were (`incremental.SameObjects`).
        self.base_attempt: str | None = None
        #: The arrays the base was saved from, by (item, leaf), weakly (`same_objects`).
        self.objects: dict[tuple[str, str], weakref.ref[Any]] = {}

    async def write(
        self,
        step: int,
        staged: Staged,
        configs: dict[str, JsonItem],
        metrics: dict[str, Any],
        metadata: dict[str, Any],
        start: float,
        waited: float,
        base: int | None,
        same: SameObjects | None,
        objects: dict[tuple[str, str], weakref.ref[Any]],
        changed: Declared | None = None,
    ) -> SaveStats:
        target = self.target  # on tiers: room is checked on the fast tier

        async def save(base: int | None) -> SaveResult:
            return await save_items(
                target,
                {**staged.tree, **configs},
                step=step,
                metadata={**metadata, "metrics": metrics} if metrics else metadata,
                timeout=self.options.timeout,
                timings={"staging": staged.seconds},
                base=base,
                same_objects=same if base is not None else None,
                changed=changed if base is not None else None,
                # Digests serve incremental saves only: a hash of every byte, skipped
                # where no save of this manager will compare them.
                digests=self.options.incremental,
                codecs=self.options.codecs,
                casts=self.options.casts,
                chunk_bytes=self.options.chunk_bytes,
            )

        try:
            result = await save(base)
        except BaseStepGoneError as exc:
            # The base was deleted (by someone else: the keep policy never deletes the
            # latest committed step), or on tiers evicted from the fast tier for room,
            # before or while this save referenced it. Nothing was
            # committed and the attempt is abandoned: the staged copy is still intact, so
            # the step is saved again in full, once. Every process gets this error type.
            log.warning("ckptstore: step %d saved in full: %s", step, exc)
            base = None
            result = await save(None)
        # The next save's base, the attempt it is, and the arrays it was saved from.
        self.base, self.base_attempt, self.objects = step, result.attempt, objects
        durable = time.perf_counter() - start
        self._records[step] = P.StepRecord(step, time.time(), metrics)
        # The step is committed: the handle completes now. The keep policy runs after it,
        # beside the next save if there is one (it only ever deletes committed steps), and
        # after the previous keep-policy run.
        retention = self._retention
        retention.after(step, self._loop)
        stats = SaveStats(
            step=step,
            attempt=result.attempt,
            waited=waited,
            staging=staged.seconds,
            write=result.timings.get("write", 0.0),
            merge=result.timings.get("merge", 0.0),
            commit=result.timings.get("commit", 0.0),
            durable=durable,
            bytes=result.bytes,
            bytes_written=result.bytes_written,
            staged_bytes=staged.nbytes,
            bytes_referenced=result.bytes_referenced,
            base=base if result.bytes_referenced else None,
            staging_mode=staged.mode,
            staging_reason=staged.reason,
            unpromoted=tuple(sorted((retention.unpromoted | retention.promoting) - {step})),
        )
        self.stats.append(stats)
        return stats

    def same_objects(
        self, arrays: Mapping[str, Any]
    ) -> tuple[dict[str, set[str]], dict[tuple[str, str], weakref.ref[Any]]]:
        """Per item, the leaves that are the very `jax.Array` objects the previous save of
        this manager (the base of this one) was made from: a jax array never changes, so
        the base's digests hold for them and they are not digested again. Not an array in
        host memory: it may be a numpy buffer changed in place since (`may_share_host_memory`),
        so it is digested like any leaf. And weak references to this save's arrays, for the
        next one."""
        same: dict[str, set[str]] = {}
        seen: dict[tuple[str, str], weakref.ref[Any]] = {}
        for item, tree in arrays.items():
            for name, value in flatten(tree):
                if not isinstance(value, jax.Array) or may_share_host_memory(value):
                    continue
                seen[(item, name)] = weakref.ref(value)
                previous = self.objects.get((item, name))
                if previous is not None and previous() is value:
                    same.setdefault(item, set()).add(name)
        return same, seen
