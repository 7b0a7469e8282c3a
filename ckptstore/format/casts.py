"""Lossy casts, only where asked: chosen floating-point leaves stored in a narrower dtype.

``save(..., casts={"opt/*": "bfloat16"})`` stores each matching leaf as that dtype (a
float32 Adam moment in half the bytes) and records the dtype it had
(`LeafInfo.cast_from`); a restore gives it back in that dtype, so the tree a training
loop gets has the dtypes it saved, with values rounded once. Never a default: a save
without ``casts`` stores every value exactly.

Rounding is numpy's (ml_dtypes') and XLA's conversion, which agree: to the nearest
representable value, ties to even. A value beyond the target's range becomes infinity
(``bfloat16``, ``float16``, ``float8_e5m2``) or NaN (``float8_e4m3fn``, which has no
infinity); NaN stays NaN; values below the smallest subnormal become zero. ``bfloat16``
keeps float32's range with 8 bits of precision (relative error at most 2**-9).

Only leaves whose dtype is floating point and wider than the target are cast; others a
pattern matches (integers, booleans, leaves already that narrow) are stored as they are.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import ConfigError
from ckptstore.format.codecs import pattern_rules
from ckptstore.format.leaves import LeafInfo, dtype_of

#: The dtypes a leaf may be stored as, by name.
TARGETS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float32")


def target_dtype(value: Any, *, what: str = "casts") -> str:
    """A cast's target as its dtype name (one of `TARGETS`: a name, a numpy or jax dtype);
    `ConfigError` naming ``what`` otherwise."""
    try:
        name = np.dtype(value).name if not isinstance(value, str) else value.strip()
    except TypeError:
        name = None
    if name not in TARGETS:
        raise ConfigError(f"{what}: cannot store leaves as {value!r} (one of {', '.join(TARGETS)})")
    return name


#: The dtypes a cast may narrow from.
SOURCES = ("float64", "float32", "float16", "bfloat16")


def narrows(source: str, target: str) -> bool:
    """Whether storing a ``source`` leaf as ``target`` is a narrowing float cast."""
    return source in SOURCES and dtype_of(source).itemsize > dtype_of(target).itemsize


Chooser = Callable[[str, LeafInfo], Any]


@dataclass(frozen=True)
class CastPolicy:
    """Which leaves a save stores narrower: ``rules`` (``(pattern, dtype name)``, the first
    glob pattern matching the leaf's name decides) or ``choose`` (``(name, info) ->
    dtype or None``, asked for leaves no rule matched). Empty: no leaf is cast."""

    rules: tuple[tuple[str, str], ...] = ()
    choose: Chooser | None = None

    @property
    def empty(self) -> bool:
        return not self.rules and self.choose is None

    def target_for(self, info: LeafInfo) -> str | None:
        """The dtype ``info``'s leaf is stored as, if it is cast (a narrowing only)."""
        target = None
        for pattern, dtype in self.rules:
            if fnmatch.fnmatchcase(info.name, pattern):
                target = dtype
                break
        else:
            if self.choose is not None:
                chosen = self.choose(info.name, info)
                if chosen is not None:
                    target = target_dtype(chosen, what=f"casts({info.name!r})")
        if target is None or info.kind == "scalar" or info.prng_impl is not None:
            return None
        return target if narrows(info.dtype, target) else None

    @classmethod
    def of(cls, spec: Any, *, what: str = "casts") -> CastPolicy:
        """The policy ``spec`` describes: None (no casts), ``{pattern: dtype}``, a callable
        ``(name, info) -> dtype or None``, or a `CastPolicy`; `ConfigError` otherwise."""
        if isinstance(spec, CastPolicy):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, Mapping):
            return cls(rules=pattern_rules(spec, target_dtype, what))
        if callable(spec):
            return cls(choose=spec)
        raise ConfigError(
            f"{what}: expected {{pattern: dtype}} or a callable, got {type(spec).__name__}"
        )
