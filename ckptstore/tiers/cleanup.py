"""`delete_step` and `gc` over both tiers of a `Tiered` target (entries named by URL).

A deletion removes the fast copy first, leaving its ``DELETED`` record in the attempt: a
promotion of it in flight finds that after creating the durable marker and takes the
marker back (`ckptstore.tiers.promote.promote_step`). The durable tier is looked at only
then, so between the two one of them sees the other; killed in between, the durable copy
is still listed, never a fast-only step a later promotion would bring back.

`gc` collects each tier as `ckptstore.checkpoint.cleanup.collect` does: an interrupted
promotion's objects are garbage of the durable tier until its marker lands, and the grace
period keeps a running one's.
"""

from __future__ import annotations

from ckptstore.checkpoint.cleanup import (
    DEFAULT_GRACE,
    Removal,
    check_grace,
    collect,
    remove_step,
)
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.format import layout
from ckptstore.protocol import is_committed
from ckptstore.tiers.target import Tiered


async def delete_step(tiers: Tiered, step: int) -> Removal:
    """Delete committed ``step`` from both tiers, the fast one first (module docstring);
    `CheckpointNotFoundError` if neither has it committed."""
    step = layout.check_step(step)
    async with tiers.opened() as (fast, durable):
        removal = Removal()
        found = False
        for backend in (fast, durable):
            if await is_committed(backend, step):
                found = True
                removal.absorb(
                    await remove_step(backend, step, tombstone=backend is fast), backend.url
                )
        if not found:
            raise CheckpointNotFoundError(
                f"step {step} is committed on neither tier",
                backend=f"{fast.url} | {durable.url}",
                key=layout.commit_key(step),
            )
        return removal


async def gc(tiers: Tiered, *, older_than: float = DEFAULT_GRACE, dry_run: bool = False) -> Removal:
    """`ckptstore.checkpoint.cleanup.collect` on each tier, the fast one first."""
    check_grace(older_than)
    removal = Removal()
    async with tiers.opened() as (fast, durable):
        for backend in (fast, durable):
            removal.absorb(await collect(backend, older_than, dry_run), backend.url)
    return removal
