"""Saving to a `Tiered` target: the save core (`ckptstore.checkpoint.save`) on the fast
tier, with what tiers add to its phases (`TierHooks`); a partial save on tiers is a session
on the fast tier that `refuse_host_local` checks first.

What a save on tiers adds, by phase of the save protocol:

1. every process measures whether the fast tier is host-local (`hostlocal.fast_is_shared`);
   there, the step must be uncommitted on the durable tier too (process 0 asks it, for a
   few seconds: `tiers.bounded`) and not staged already.
   Every process checks its own fast tier has room for what it writes (`room.ensure_room`,
   evicting promoted steps if that is what it takes); one failing fails all, before
   anything is written;
2. on a host-local fast tier small leaves are not packed (promotion reads OCDBT stores
   only), and a process whose devices' slices fit writes this host's own copy of them
   (`hostlocal.write_host_view`) for a restart on the same hosts;
3. on a host-local fast tier process 0 does not merge (promotion merges on the durable
   tier) and stages the step instead of committing it (`hostlocal.stage`);
4. there, every other process stages its part; the save returns once all have.

On a shared fast tier only the room check differs from a plain save; an incremental save
(``base=``) references its base's attempt on the fast tier (host-local fast tiers refuse
one in phase 1). Promotion to the durable tier is separate (`ckptstore.tiers.promote`).
"""

from __future__ import annotations

from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.incremental import Unchanged
from ckptstore.checkpoint.save import (
    PreparedItem,
    SaveHooks,
)
from ckptstore.checkpoint.stagedrecord import staged_key
from ckptstore.errors import AlreadyExistsError, UnsupportedOperationError
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import Attempt, Fate
from ckptstore.runtime import distributed
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.bounded import durable_uncommitted
from ckptstore.tiers.hostlocal import (
    can_write_host_view,
    fast_is_shared,
    host_view_bytes,
    stage,
    write_host_view,
)
from ckptstore.tiers.room import Room, bytes_to_write, ensure_room
from ckptstore.tiers.target import Tiered


class TierHooks(SaveHooks):
    """A save's additions on tiers (the module docstring, phase by phase); one per save."""

    def __init__(self, room: Room, incremental: bool = False):
        self.room = room
        self.incremental = incremental  # the save names a base (docs/incremental.md)
        self.host_local = False  # the fast tier is each host's own (measured in phase 1)
        self.host_view = False  # this process writes this host's own copy

    async def before_attempt(
        self, backend: Backend, items: dict[str, PreparedItem], step: int, handoff: Handoff
    ) -> None:
        self.host_local = not await fast_is_shared(backend, handoff)
        if self.host_local and self.incremental:  # every process measured the same
            raise UnsupportedOperationError(
                f"incremental save (base=) of step {step}: the fast tier {backend.url} is "
                "host-local (each host's own disk), where a step is staged per host and "
                "merged on the durable tier by promotion, and a base is read from one "
                "committed copy. Save it without base=, or to a fast tier every process "
                "shares"
            )
        values = [value for item in items.values() for _, value in item.named]
        if self.host_local:  # process 0 asks; a durable tier that is down is left out
            durable = self.room.durable
            await handoff.primary(lambda: durable_uncommitted(durable, step, handoff.timeout))
            self.host_view = can_write_host_view(values, handoff.me)
        self.packs = self.merge = not self.host_local

    async def before_write(
        self,
        backend: Backend,
        items: dict[str, PreparedItem],
        step: int,
        handoff: Handoff,
        same: Unchanged,
    ) -> None:
        """Room for what this process will write: not the leaves an incremental save
        references, and never by evicting its base (its bytes would stay, referenced)."""
        values = [value for item in items.values() for _, value in item.named]
        keep = {same.base.manifest.step} if same.base is not None else set()

        async def make_room() -> dict[str, Any]:
            if self.host_local and await backend.exists(staged_key(step)):
                raise AlreadyExistsError(
                    f"step {step} is already staged", backend=backend.url, key=staged_key(step)
                )
            mine = sum(
                bytes_to_write(i.named, i.leaves, handoff.me, skip=same.leaves.get(name, set()))
                for name, i in items.items()
            )
            if self.host_view:
                mine += host_view_bytes(values, handoff.me)
            return {"evicted": await ensure_room(backend, self.room, mine, keep=keep)}

        await handoff.everyone(make_room)
        await handoff.primary(handoff.reports)

    async def after_write(
        self,
        backend: Backend,
        where: layout.AttemptDir,
        items: dict[str, PreparedItem],
        handoff: Handoff,
    ) -> None:
        if self.host_view:  # this host's copy, for a restart on the same hosts (`hostlocal`)
            for name, item in items.items():
                leaves = list(zip(item.leaves, (value for _, value in item.named), strict=True))
                await write_host_view(backend, where, name, leaves, handoff.me)

    async def finish(
        self, attempt: Attempt, manifest: Manifest, fate: Fate, handoff: Handoff
    ) -> None:
        if not self.host_local:
            await super().finish(attempt, manifest, fate, handoff)
            return
        where = attempt.where
        await stage(
            attempt.backend,
            where.step,
            str(where.attempt),
            0,
            handoff.count,
            manifest,
            self.host_view,
        )

    async def after_finish(
        self, backend: Backend, where: layout.AttemptDir, handoff: Handoff
    ) -> None:
        if not self.host_local:
            return

        async def stage_mine() -> dict[str, Any]:
            if handoff.me != 0:
                await stage(
                    backend,
                    where.step,
                    str(where.attempt),
                    handoff.me,
                    handoff.count,
                    None,
                    self.host_view,
                )
            return {}

        await handoff.everyone(stage_mine)
        await handoff.primary(handoff.reports)


def hooks(tiers: Tiered, durable: Backend, *, incremental: bool = False) -> TierHooks:
    """The hooks of one save on ``tiers`` (``durable``: its durable tier, opened;
    ``incremental``: the save names a base)."""
    return TierHooks(Room(durable, tiers.free_margin), incremental)


async def refuse_host_local(fast: Backend, step: int, timeout: float) -> None:
    """A multi-process partial save on host-local fast tiers (`hostlocal`) is refused up
    front with `UnsupportedOperationError`: its finalize merges every part's per-process
    stores on one fast tier, and each host's parts are on its own disk only. Collective
    (every process gets the same answer)."""
    if distributed.process_count() == 1:
        return
    if not await fast_is_shared(fast, Handoff(f"partial/{step}/tiers", timeout)):
        raise UnsupportedOperationError(
            f"partial_save of step {step}: the fast tier {fast.url} is host-local (not one "
            "storage every process sees), and a partial save's finalize merges every "
            "process's parts on one fast tier. Save the step with ckptstore.save (staged on "
            "each host, merged on the durable tier by promotion), or give partial_save the "
            "durable tier or a fast tier every process shares"
        )
