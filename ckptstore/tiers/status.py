"""Where each step of a `Tiered` target is (fast, durable, both, staged on this host),
and how far the promotion of those not durable yet got: what `ckptstore ls PROFILE`
shows and what the manager reads to decide what to promote next."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.stagedrecord import read_staged, staged_key, staged_steps
from ckptstore.errors import CorruptCheckpointError, NotFoundError, TransientStorageError
from ckptstore.format import layout
from ckptstore.protocol import Marker, committed_steps, read_marker
from ckptstore.tiers.hostlocal import is_promoted, promoted_part
from ckptstore.tiers.promote import attempt_objects
from ckptstore.tiers.target import Tiered


@dataclass
class TierStatus:
    """Where each step is: "fast" (committed on the fast tier only), "durable", "both", or
    "staged": this host's part of a step staged on host-local fast tiers
    (`ckptstore.tiers.hostlocal`) that the durable tier has not committed yet (one
    it committed from the same attempt is "both": this host's copy serves a restore here).

    ``uploaded``: for each "fast" or "staged" step, the fraction of its bytes (of a staged
    step: of this host's part) already on the durable tier, i.e. how far a promotion got.
    ``saved``: when each such step was committed or staged (None where the store cannot
    tell).
    """

    steps: dict[int, str] = field(default_factory=dict)
    uploaded: dict[int, float] = field(default_factory=dict)
    saved: dict[int, float | None] = field(default_factory=dict)
    #: Why the durable tier could not be read (None: it answered); then ``steps`` holds
    #: the fast tier's steps only, and ``uploaded`` nothing.
    durable_error: str | None = None

    @property
    def unpromoted(self) -> list[int]:
        """Steps committed on the fast tier only."""
        return sorted(s for s, where in self.steps.items() if where == "fast")

    @property
    def lagging(self) -> list[int]:
        """Steps not durable yet: committed on the fast tier, or staged on this host."""
        return sorted(s for s, where in self.steps.items() if where in ("fast", "staged"))


async def status(tiered: Tiered) -> TierStatus:
    """Each step's tiers, and how far the promotion of those not durable yet got. While
    the durable tier does not answer (`TransientStorageError`), what the fast tier holds,
    each step "fast" or "staged", and why in ``durable_error``."""
    async with tiered.opened() as (fast, durable):
        on_fast, staged = await asyncio.gather(committed_steps(fast), staged_steps(fast))
        out = TierStatus()
        try:
            on_durable = await committed_steps(durable)
        except TransientStorageError as exc:
            out.durable_error = str(exc)
            for step in sorted(set(on_fast) | set(staged)):
                out.steps[step] = "fast" if step in on_fast else "staged"
                out.saved[step] = await _saved(fast, step)
            return out
        for step in sorted(set(on_fast) | set(on_durable) | set(staged)):
            if step in on_fast:
                out.steps[step] = "both" if step in on_durable else "fast"
            elif step in staged:
                mine = await read_staged(fast, step)
                promoted = mine is not None and await is_promoted(durable, mine)
                if step not in on_durable:
                    out.steps[step] = "staged"
                else:  # "durable": this host's part is of another attempt (garbage)
                    out.steps[step] = "both" if promoted else "durable"
            else:
                out.steps[step] = "durable"
        for step in out.lagging:
            out.uploaded[step], out.saved[step] = await _progress(fast, durable, step)
    return out


async def _saved(fast: Backend, step: int) -> float | None:
    """When ``step`` was committed or staged on the fast tier (None: deleted or damaged
    meanwhile)."""
    try:
        return (await fast.stat(_record_key(await read_marker(fast, step), step))).mtime
    except (NotFoundError, CorruptCheckpointError):
        return None


def _record_key(marker: Marker | None, step: int) -> str:
    """What says when ``step`` was saved on the fast tier: its marker, or (no marker: a
    step staged on host-local tiers) this host's staged record."""
    return marker.key if marker is not None else staged_key(step)


async def _progress(fast: Backend, durable: Backend, step: int) -> tuple[float, float | None]:
    """The fraction of a step's bytes the durable tier holds (with the right size), and
    when the fast tier's marker was written."""
    try:
        marker = await read_marker(fast, step)
        if marker is not None:
            root, objects = marker.where.root, await attempt_objects(fast, marker)
        else:
            mine = await read_staged(fast, step)
            if mine is None:
                return 0.0, None
            root = layout.AttemptDir(step, mine.attempt).root
            objects = [i async for i in fast.list(root) if promoted_part(i.key, root, mine.process)]
        saved = (await fast.stat(_record_key(marker, step))).mtime
    except (NotFoundError, CorruptCheckpointError):  # deleted or damaged meanwhile
        return 0.0, None
    have = {i.key: i.size async for i in durable.list(root)}
    total = sum(o.size for o in objects)
    landed = sum(o.size for o in objects if have.get(o.key) == o.size)
    return (landed / total if total else 0.0), saved
