"""A `Tiered` target: a fast tier in front of a durable one, and telling one apart from a
single backend (`as_tiered`)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import env_profile, load_profile, redact, target_profile
from ckptstore.checkpoint.target import Target, opened
from ckptstore.errors import ConfigError

#: Free space a save leaves on a local fast tier beyond what it writes (`Tiered.free_margin`).
FREE_MARGIN = 256 << 20


@dataclass(frozen=True)
class Tiered:
    """A fast tier (local NVMe) in front of a durable one (S3, GCS); each a `Target`.

    Saves commit on the fast tier; promotion (``ckptstore.promote``) copies committed steps
    to the durable tier; reads use the nearest tier with a good copy. ``keep_fast``: after
    promoting, keep only this many latest promoted steps on the fast tier (None: all).
    ``free_margin``: bytes a save must leave free on a local fast tier (see
    `ckptstore.tiers.read.ensure_room`).
    """

    fast: Target
    durable: Target
    keep_fast: int | None = None
    free_margin: int = FREE_MARGIN

    def __repr__(self) -> str:  # the targets as `redact` shows URLs: never a credential
        return (
            f"Tiered(fast={_shown(self.fast)}, durable={_shown(self.durable)}, "
            f"keep_fast={self.keep_fast!r}, free_margin={self.free_margin!r})"
        )

    def __post_init__(self) -> None:
        for name in ("keep_fast", "free_margin"):
            value = getattr(self, name)
            if (value is not None or name == "free_margin") and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise ConfigError(f"Tiered {name} must be an int, got {type(value).__name__}")
        if self.keep_fast is not None and self.keep_fast < 1:
            raise ConfigError(f"keep_fast must be >= 1 (or None), got {self.keep_fast}")
        if self.free_margin < 0:
            raise ConfigError(f"free_margin must be >= 0 bytes, got {self.free_margin}")

    @classmethod
    def from_profile(cls, path: str | os.PathLike[str]) -> Tiered:
        """The ``[tiers]`` table of a profile: ``fast``, ``durable`` (URLs or profile paths,
        relative to the profile's folder), ``keep_fast`` and ``free_margin`` (bytes)."""
        if "://" in str(path):
            raise ConfigError(
                f"{path} is a URL: two tiers come from a .toml profile with a [tiers] table "
                "(fast, durable)"
            )
        table = load_profile(path).get("tiers")
        if not isinstance(table, dict):
            raise ConfigError(f"profile {path} has no [tiers] table")
        unknown = set(table) - {"fast", "durable", "keep_fast", "free_margin"}
        if (
            unknown
            or not isinstance(table.get("fast"), str)
            or not isinstance(table.get("durable"), str)
        ):
            raise ConfigError(
                f"profile {path} [tiers] needs fast and durable (strings), and optionally "
                f"keep_fast and free_margin; unknown keys {sorted(unknown)}"
            )
        base = os.path.dirname(os.path.abspath(path))

        def resolve(target: str) -> str:
            if target.endswith(".toml") and not os.path.isabs(target):
                return os.path.join(base, target)
            return target

        margin = table.get("free_margin", FREE_MARGIN)
        if isinstance(margin, bool) or not isinstance(margin, int):
            raise ConfigError(f"profile {path} [tiers] free_margin must be bytes (an int)")
        keep = table.get("keep_fast")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)):
            raise ConfigError(
                f"profile {path} [tiers] keep_fast must be a number of steps (an int >= 1), "
                f"not a {type(keep).__name__}"
            )
        return cls(resolve(table["fast"]), resolve(table["durable"]), keep, margin)

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[tuple[Backend, Backend]]:
        """Both tiers' backends (those opened here are closed afterwards)."""
        async with AsyncExitStack() as stack:
            fast = await stack.enter_async_context(opened(self.fast))
            durable = await stack.enter_async_context(opened(self.durable))
            check_distinct(fast, durable)
            yield fast, durable


def check_distinct(fast: Backend, durable: Backend) -> None:
    """`ConfigError` if the two tiers are one storage (or one lies inside the other),
    however their URLs are spelled: trimming the fast tier would delete the only copy."""
    a, b = fast.location, durable.location
    if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
        raise ConfigError(
            f"the fast tier {fast.url} and the durable tier {durable.url} are the same "
            "storage (or one lies inside the other): give the tiers separate locations"
        )


def _shown(target: Target) -> str:
    if isinstance(target, Backend):
        return repr(target)
    return repr(redact(os.fspath(target)))


#: Anything the public entry points accept: a `Target`, or a `Tiered` pair of them.
AnyTarget = Target | Tiered


def single(target: AnyTarget) -> Target:
    """``target`` where one backend is meant (after `as_tiered` said it is not tiers)."""
    if isinstance(target, Tiered):
        raise ConfigError(f"{target!r} is two tiers, not one backend")
    return target


def as_tiered(target: AnyTarget | None) -> Tiered | None:
    """``target`` as tiers: a `Tiered`, or a ``.toml`` profile with a ``[tiers]`` table
    (for None: the profile ``$CKPTSTORE_PROFILE`` names, if it has one)."""
    if isinstance(target, Tiered):
        return target
    if isinstance(target, Backend):
        return None
    if target is None:
        target = env_profile()
        if target is None:
            return None
    named = target_profile(target)
    if named is not None and named.is_file() and "tiers" in load_profile(named):
        return Tiered.from_profile(str(named))
    return None
