"""The policy that picks a codec per leaf: glob patterns on the leaf's name (as ckptstore
names leaves: ``params/dense/kernel``), a callable, a default. `CodecPolicy.of` accepts every
form ``save(..., codecs=...)``, `ManagerOptions` and profiles take.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ckptstore.errors import ConfigError
from ckptstore.format.codecs.base import Codec
from ckptstore.format.codecs.registry import parse_codec

if TYPE_CHECKING:
    from ckptstore.format.leaves import LeafInfo

T = TypeVar("T")

Chooser = Callable[[str, "LeafInfo"], Any]


@dataclass(frozen=True)
class CodecPolicy:
    """Which codec each leaf of a save gets.

    ``rules``: ``(pattern, codec)`` pairs, tried in order; the first whose glob pattern
    (`fnmatch.fnmatchcase`: ``*`` also matches ``/``) matches the leaf's name decides.
    ``choose``: a callable ``(name, info) -> codec`` (a `Codec`, None or a string form),
    asked for leaves no rule matched. ``default``: the codec of every other leaf.
    The default policy compresses nothing: a save writes exactly the bytes it always did.
    """

    rules: tuple[tuple[str, Codec | None], ...] = ()
    choose: Chooser | None = None
    default: Codec | None = None

    @property
    def empty(self) -> bool:
        """Whether every leaf is stored raw, whatever its name."""
        return (
            self.default is None and self.choose is None and all(c is None for _, c in self.rules)
        )

    def codec_for(self, info: LeafInfo) -> Codec | None:
        """The codec of the leaf ``info`` describes."""
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(info.name, pattern):
                return codec
        if self.choose is not None:
            return parse_codec(self.choose(info.name, info), what=f"codecs({info.name!r})")
        return self.default

    def apply(self, infos: Iterable[LeafInfo]) -> list[LeafInfo]:
        """``infos`` with each one's codec set (unchanged where it is raw)."""
        if self.empty:
            return list(infos)
        out = []
        for info in infos:
            codec = self.codec_for(info)
            out.append(info if codec == info.codec else info.with_codec(codec))
        return out

    @classmethod
    def of(cls, spec: Any, *, what: str = "codecs") -> CodecPolicy:
        """The policy ``spec`` describes: None or ``"none"`` (nothing compressed); one codec
        (`Zstd`, ``"zstd:3"``) for every leaf; a mapping ``{pattern: codec}`` (first match
        wins; ``"*"`` as the last pattern sets the rest); a callable ``(name, info) ->
        codec``; or a `CodecPolicy`. `ConfigError` naming what is wrong otherwise."""
        if isinstance(spec, CodecPolicy):
            return spec
        if spec is None or isinstance(spec, (str, Codec)):
            return cls(default=parse_codec(spec, what=what))
        if isinstance(spec, Mapping):
            return cls(rules=pattern_rules(spec, parse_codec, what))
        if callable(spec):
            return cls(choose=spec)
        raise ConfigError(
            f"{what}: expected a codec, a {{pattern: codec}} mapping or a callable, "
            f"got {type(spec).__name__}"
        )


def pattern_rules(
    spec: Mapping[Any, Any], parse: Callable[..., T], what: str
) -> tuple[tuple[str, T], ...]:
    """``{glob pattern: value}`` as (pattern, ``parse(value, what=...)``) rules in order
    (the codec and cast policies' tables); `ConfigError` for a pattern that is not a
    non-empty string."""
    rules = []
    for pattern, value in spec.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{what}: a pattern must be a non-empty string, got {pattern!r}")
        rules.append((pattern, parse(value, what=f"{what}[{pattern!r}]")))
    return tuple(rules)
