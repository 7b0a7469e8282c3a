"""The ``ckptstore`` command on tiers: ``promote`` and ``ls`` of a profile with a ``[tiers]``
table (``info``, ``verify``, ``rm`` and ``gc`` take tiers through the ordinary commands)."""

from __future__ import annotations

import json
import sys
import time

from ckptstore.checkpoint.commit import load_committed
from ckptstore.checkpoint.target import Tiered, opened
from ckptstore.cli_text import count, duration_text, human
from ckptstore.lifecycle.tiers import promote, status

_TIER_TEXT = {
    "fast": "fast only (not promoted yet)",
    "both": "fast + durable",
    "durable": "durable",
    "staged": "staged on this host (multi-host: merged on the durable tier by promotion)",
}


async def cmd_ls_tiers(profile: str, as_json: bool) -> int:
    """Each committed step's tiers, and how far promotion lags behind."""
    tiered = Tiered.from_profile(profile)
    where = (await status(tiered)).steps
    lagging = [s for s, w in where.items() if w == "fast"]
    oldest = None
    if lagging:
        async with opened(tiered.fast) as fast:
            oldest = (await load_committed(fast, min(lagging))).created
    if as_json:
        lag = None if oldest is None else time.time() - oldest
        print(json.dumps({"steps": where, "unpromoted": lagging, "lag_seconds": lag}, indent=1))
        return 0
    if not where:
        print(f"no committed checkpoints on either tier of {profile}")
        return 0
    print(f"{'STEP':>10}  TIERS")
    for step, w in where.items():
        print(f"{step:>10}  {_TIER_TEXT[w]}")
    if oldest is None:
        print("promotion lag: none")
    else:
        print(
            f"promotion lag: {count(len(lagging), 'step')}, the oldest saved "
            f"{duration_text(time.time() - oldest)} ago"
        )
    return 0


async def cmd_promote(profile: str, step: int | None, show_progress: bool) -> int:
    tiered = Tiered.from_profile(profile)

    def progress(done: int, total: int) -> None:
        if show_progress:
            print(f"\r  {human(done)} of {human(total)}", end="", file=sys.stderr, flush=True)

    for p in await promote(tiered, step, progress=progress):
        if show_progress and p.copied:
            print(file=sys.stderr)
        what = (
            "already durable"
            if p.already
            else (
                f"copied {p.copied} of {count(p.objects, 'object')}, {human(p.bytes)} "
                f"in {p.seconds:.1f} s"
            )
        )
        print(f"step {p.step}: {what}")
    where = (await status(tiered)).steps
    print(f"durable now: {sorted(s for s, w in where.items() if w in ('both', 'durable'))}")
    return 0
