"""`ManagerOptions`: everything about a `CheckpointManager` that depends on the environment,
in one object, loadable from the ``[manager]`` table of a backend profile.

```toml
[manager]
save_every_steps = 1000          # any of these save keys combine with AnyOf
save_every_seconds = "30m"
save_at_steps = [10, 20]
save_initial = true
save_continuous = "5m"           # minimum interval between continuous saves
save_on_preemption = true
keep_latest = 3                  # any of these keep keys combine with KeepAnyOf
keep_every_steps = 10000
keep_best = { n = 1, metric = "val_acc", mode = "max" }
keep_for = "7d"
keep_every_interval = "1h"       # one step per hour of saves (Orbax's keep_time_interval)
if_busy = "wait"                 # or "skip": what save() does while a save is in flight
staging = "auto"                 # or "device", "host", "view" (see ckptstore.lifecycle.staging)
max_staging_bytes = 68719476736
timeout = "10m"                  # cross-process waits, past the other's last sign of life
gc_on_start = true
gc_grace = "10m"
incremental = false              # true: each save references what the last step holds
chunk_bytes = 131072             # big leaves' largest chunk (default 64 MiB)
codecs = "zstd:3"                # every leaf compressed; or a table, first match wins:
# [manager.codecs]
# "params/*" = "zstd:3"
# "*" = "none"
# [manager.casts]                # lossy, never a default: these leaves stored narrower
# "opt/*" = "bfloat16"
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ckptstore.errors import ConfigError
from ckptstore.format import layout
from ckptstore.format.casts import CastPolicy
from ckptstore.format.codecs import CodecPolicy
from ckptstore.lifecycle import policies as P

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: Any, *, what: str = "duration") -> float:
    """A duration: a number of seconds, or a string like ``90``, ``30m``, ``6h``, ``2d``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower()
        unit = _UNITS.get(text[-1], 0.0)
        try:
            number = float(text[:-1] if unit else text) * (unit or 1.0)
        except ValueError:
            raise ConfigError(f"{what}: not a duration: {value!r} (try 90, 30m, 6h, 2d)") from None
    else:
        raise ConfigError(f"{what}: not a duration: {value!r}")
    if not 0 <= number < float("inf"):
        raise ConfigError(f"{what}: must be a non-negative, finite duration, got {value!r}")
    return number


@dataclass
class ManagerOptions:
    """Options of a `CheckpointManager` (policies passed to the manager itself win)."""

    save_policy: P.SavePolicy | None = None  # None: save whenever save() is called
    keep_policy: P.KeepPolicy | None = None  # None: keep every step
    if_busy: Literal["wait", "skip"] = "wait"
    #: "device" copies on the devices, "host" into host memory, before save() returns;
    #: "view" holds zero-copy views of CPU device buffers (asked for only: such an array may
    #: share memory with a numpy buffer); "auto": "host" on CPU devices, else "device" where
    #: the devices have room, else "host" (ckptstore.lifecycle.staging).
    staging: Literal["auto", "device", "host", "view"] = "auto"
    max_staging_bytes: int | None = None
    #: Seconds a process waits for another's part of a collective step (a save, a
    #: promotion, the keep policy) past that process's last sign of life: one that works
    #: longer (a large promotion) is waited for (`ckptstore.runtime.beats`).
    timeout: float = 600.0
    gc_on_start: bool = True
    gc_grace: float = 600.0
    item: str = layout.DEFAULT_ITEM
    handle_sigterm: bool = True
    #: Each save after the first is incremental (``base=`` the last step this manager
    #: committed, or the latest committed when it started): leaves unchanged since then
    #: are referenced, not written (docs/incremental.md). One backend only, for now.
    incremental: bool = False
    #: Which leaves each save compresses: any form `CodecPolicy.of` takes (a codec such as
    #: ``ckptstore.Zstd(3)`` or ``"zstd:3"``, ``{glob pattern: codec}``, a callable);
    #: kept as the `CodecPolicy` it describes. None: nothing compressed (docs/codecs.md).
    codecs: Any = None
    #: Leaves each save stores in a narrower dtype, restored into the dtype they had
    #: (lossy: ``{glob pattern: dtype}`` or a callable, `CastPolicy.of`). None: none.
    casts: Any = None
    #: The largest chunk of a big leaf (None: 64 MiB). Smaller chunks let incremental saves
    #: of sparsely updated leaves (embedding tables) write only the chunks that changed
    #: (docs/incremental.md, "Chunk references"); keep it the same from one run to the next.
    chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        self.codecs = CodecPolicy.of(self.codecs, what="codecs")
        self.casts = CastPolicy.of(self.casts, what="casts")
        if self.if_busy not in ("wait", "skip"):
            raise ConfigError(f"if_busy must be 'wait' or 'skip', got {self.if_busy!r}")
        if self.staging not in ("auto", "device", "host", "view"):
            raise ConfigError(
                f"staging must be 'auto', 'device', 'host' or 'view', got {self.staging!r}"
            )
        if not isinstance(self.incremental, bool):
            raise ConfigError(f"incremental must be True or False, got {self.incremental!r}")
        if self.max_staging_bytes is not None and self.max_staging_bytes <= 0:
            raise ConfigError("max_staging_bytes must be positive")
        if self.chunk_bytes is not None and (
            isinstance(self.chunk_bytes, bool)
            or not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes <= 0
        ):
            raise ConfigError(f"chunk_bytes must be a positive integer, got {self.chunk_bytes!r}")
        layout.check_item(self.item)

    @classmethod
    def from_table(cls, table: dict[str, Any], *, source: str = "[manager]") -> ManagerOptions:
        """Options from a ``[manager]`` TOML table (see the module docstring)."""
        table = dict(table)
        saves: list[P.SavePolicy] = []
        keeps: list[P.KeepPolicy] = []
        out: dict[str, Any] = {}

        def take(key: str) -> Any:
            return table.pop(key, None)

        if (n := take("save_every_steps")) is not None:
            saves.append(P.EveryNSteps(_int(n, f"{source}.save_every_steps")))
        if (t := take("save_every_seconds")) is not None:
            saves.append(P.EveryNSeconds(seconds(t, what=f"{source}.save_every_seconds")))
        if (steps := take("save_at_steps")) is not None:
            if not isinstance(steps, list):
                raise ConfigError(f"{source}.save_at_steps must be a list of steps")
            saves.append(P.AtSteps(_int(s, f"{source}.save_at_steps") for s in steps))
        if _bool(take("save_initial"), f"{source}.save_initial"):
            saves.append(P.InitialStep())
        if (t := take("save_continuous")) is not None:
            saves.append(P.Continuous(seconds(t, what=f"{source}.save_continuous")))
        if _bool(take("save_on_preemption"), f"{source}.save_on_preemption"):
            saves.append(P.OnPreemption())
        if (n := take("keep_latest")) is not None:
            keeps.append(P.KeepLatest(_int(n, f"{source}.keep_latest")))
        if (n := take("keep_every_steps")) is not None:
            keeps.append(P.KeepEveryNSteps(_int(n, f"{source}.keep_every_steps")))
        if (best := take("keep_best")) is not None:
            fields = {"n", "metric", "mode", "keep_without_metric"}
            if not isinstance(best, dict) or set(best) - fields:
                raise ConfigError(
                    f"{source}.keep_best must be {{n, metric, mode, keep_without_metric}}"
                )
            keeps.append(
                P.KeepBest(
                    _int(best.get("n", 1), f"{source}.keep_best.n"),
                    _str(best.get("metric", ""), f"{source}.keep_best.metric"),
                    best.get("mode", "max"),
                    _bool(
                        best.get("keep_without_metric", True),
                        f"{source}.keep_best.keep_without_metric",
                    ),
                )
            )
        if (t := take("keep_for")) is not None:
            keeps.append(P.KeepFor(seconds(t, what=f"{source}.keep_for")))
        if (t := take("keep_every_interval")) is not None:
            what = f"{source}.keep_every_interval"
            keeps.append(P.KeepEveryInterval(seconds(t, what=what)))
        for key in ("timeout", "gc_grace"):
            if (t := take(key)) is not None:
                out[key] = seconds(t, what=f"{source}.{key}")
        for key in ("if_busy", "item", "staging"):
            if (v := take(key)) is not None:
                out[key] = _str(v, f"{source}.{key}")
        for key in ("gc_on_start", "handle_sigterm", "incremental"):
            if (v := take(key)) is not None:
                out[key] = _bool(v, f"{source}.{key}")
        if (v := take("codecs")) is not None:  # a string or a {pattern: codec} table
            if not isinstance(v, (str, dict)):
                raise ConfigError(
                    f"{source}.codecs must be a codec such as 'zstd:3' or a table of "
                    f"pattern = codec, got {v!r}"
                )
            out["codecs"] = CodecPolicy.of(v, what=f"{source}.codecs")
        if (v := take("casts")) is not None:  # a {pattern: dtype} table
            if not isinstance(v, dict):
                raise ConfigError(f"{source}.casts must be a table of pattern = dtype, got {v!r}")
            out["casts"] = CastPolicy.of(v, what=f"{source}.casts")
        for key in ("max_staging_bytes", "chunk_bytes"):
            if (v := take(key)) is not None:
                out[key] = _int(v, f"{source}.{key}")
        if table:
            raise ConfigError(f"{source}: unknown keys {sorted(table)}")
        if saves:
            out["save_policy"] = saves[0] if len(saves) == 1 else P.AnyOf(*saves)
        if keeps:
            out["keep_policy"] = keeps[0] if len(keeps) == 1 else P.KeepAnyOf(*keeps)
        return cls(**out)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an integer, got {value!r} (a {type(value).__name__})")
    return value


def _bool(value: Any, what: str) -> bool:
    """``value`` if a bool (None, absent: False); a string such as "no" is no bool."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be true or false, got {value!r} (a {type(value).__name__})")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string, got {value!r} (a {type(value).__name__})")
    return value
