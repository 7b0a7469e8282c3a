"""What a `CheckpointManager` does once, as it opens: its options from the target's profile,
the refusal of an incremental manager on host-local fast tiers, and the start-up `gc` (run
on the manager's loop, in the background).
"""

from __future__ import annotations

import logging

from ckptstore.api import gc
from ckptstore.backends.base import Backend
from ckptstore.backends.registry import env_profile, load_profile, target_profile
from ckptstore.checkpoint.target import Target
from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.hostlocal import fast_is_shared, known_shared
from ckptstore.tiers.target import Tiered

log = logging.getLogger("ckptstore")


def options_from_profile(target: Target | Tiered | None) -> ManagerOptions:
    """The ``[manager]`` table of the profile ``target`` is (None: the profile
    ``$CKPTSTORE_PROFILE`` names, as for the plain functions), else the defaults."""
    if target is None:
        target = env_profile()  # unset: the defaults, and `open_target` says what is missing
    if target is None or isinstance(target, (Backend, Tiered)):
        return ManagerOptions()
    named = target_profile(target)
    if named is not None and named.is_file():
        table = load_profile(named).get("manager")
        if table is not None:
            return ManagerOptions.from_table(table, source=f"{named} [manager]")
    return ManagerOptions()


async def refuse_host_local(fast: Backend, count: int, timeout: float) -> None:
    """`ConfigError` where the fast tier is each host's own disk (measured by every
    process, at construction: collective): there a step is staged per host and merged
    on the durable tier by promotion, so no fast-tier copy can serve as a base, and
    every incremental save would be refused (`tiers.save`)."""
    shared = known_shared(fast, count)
    if shared is None:
        shared = await fast_is_shared(fast, Handoff("manager/fast-tier", timeout))
    if not shared:
        raise ConfigError(
            "ManagerOptions(incremental=True) on tiers needs a fast tier every process "
            f"shares; {fast.url} is host-local (each host's own disk), where a "
            "step is staged per host and merged on the durable tier by promotion, and an "
            "incremental save reads its base from one committed copy on the fast tier. "
            "Drop incremental=True, or use a shared fast tier"
        )


async def collect_at_start(backend: Backend, grace: float) -> None:
    """`gc` of the target (the fast tier), skipped with a warning where a committed step's
    manifest cannot be read: what it references is then unknown, so nothing is collected
    on a guess (a restore reads such a step from its other copy)."""
    try:
        removed = await gc(backend, older_than=grace)
    except CorruptCheckpointError as exc:
        log.warning("ckptstore: start-up gc skipped: %s", exc)
        return
    if removed.entries:
        log.info("ckptstore: removed %d stale attempts", len(removed.entries))
