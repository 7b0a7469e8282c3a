"""The interleaving checker's outage actor: the durable tier goes away and comes back at
chosen points of a promotion, a `delete_step` or a `gc` on tiers.

The outage is an actor of two steps, each a gate of its own: "goes away" sets the durable
tier down (every operation on it that passes the gate fails as a refused connection does,
`InjectedFault`, transient), "comes back" sets it up again. A schedule places both among
the other actors' operations, so an outage can cover any run of them: a promotion's copy,
its marker, a delete's revocation on the durable tier. Besides `check_world`'s invariants
(every listed step restores bit-exact from the tiers and verifies; only typed errors),
once the outage is over a promotion of what the fast tier holds catches up: every step on
the fast tier is then on the durable one and restores bit-exact from it alone
(`catches_up`); a step a `delete_step` removed stays removed (`stays_deleted`).
"""

from __future__ import annotations

import ckptstore
from tests.campaigns.interleave import (
    Scenario,
    World,
    _same,
    delete_actor,
    gc_actor,
    promote_actor,
    promoted_half,
    stays_deleted,
)


async def outage_actor(world: World) -> None:
    """The durable tier goes away, then comes back, each at a point the schedule picks."""
    async with world.scheduler.gate("outage: the durable tier goes away"):
        world.durable.down = True
    async with world.scheduler.gate("outage: the durable tier comes back"):
        world.durable.down = False


async def catches_up(world: World) -> list[str]:
    """After the outage: a promotion (ungated) brings every fast-tier step to the durable
    tier, where each restores bit-exact and verifies from that tier alone."""
    try:
        await ckptstore.promote(world.tiers)
    except ckptstore.CkptStoreError as exc:
        return [f"the promotion after the outage failed: {exc!r}"]
    out = []
    durable = set(await ckptstore.list_steps(world.durable.inner))
    for step in await ckptstore.list_steps(world.fast.inner):
        if step not in durable:
            out.append(f"step {step} is on the fast tier and not durable after the catch-up")
            continue
        got = await ckptstore.restore(world.durable.inner, step=step)
        if not any(_same(got, want) for want in world.candidates.get(step, [])):
            out.append(f"durable step {step} holds a tree no one saved")
        if not (await ckptstore.verify(world.durable.inner, step=step)).ok:
            out.append(f"durable step {step} fails verify after the catch-up")
    return out


async def deleted_or_caught_up(world: World) -> list[str]:
    return await stays_deleted(world) if world.deleted else await catches_up(world)


OUTAGE = [
    Scenario(
        "the durable tier goes away and comes back during a promotion",
        promoted_half,
        {"outage": outage_actor, "promote": promote_actor},
        check=catches_up,
        tiered=True,
    ),
    Scenario(
        "the durable tier goes away and comes back during delete_step on tiers",
        promoted_half,
        {"outage": outage_actor, "delete": delete_actor(tiered=True)},
        check=deleted_or_caught_up,
        tiered=True,
    ),
    Scenario(
        "the durable tier goes away and comes back during gc of both tiers",
        promoted_half,
        {"outage": outage_actor, "gc": gc_actor(tiered=True)},
        check=catches_up,
        tiered=True,
    ),
]

OUTAGE_TRIPLES = [
    Scenario(
        "an outage, a promotion and delete_step on tiers",
        promoted_half,
        {"outage": outage_actor, "promote": promote_actor, "delete": delete_actor(tiered=True)},
        check=deleted_or_caught_up,
        tiered=True,
    ),
    Scenario(
        "an outage, two promotions and gc of both tiers",
        promoted_half,
        {"outage": outage_actor, "promote": promote_actor, "gc": gc_actor(tiered=True)},
        check=catches_up,
        tiered=True,
    ),
]
