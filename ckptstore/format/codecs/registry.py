"""The codecs ckptstore knows by name, and the string forms of a codec.

A codec's string form is ``"<name>"`` or ``"<name>:<argument>"`` (``"zstd:3"``); ``"none"``
is raw. `register_codec` adds a `Codec` class under its ``name``; a package may also name
one in its ``ckptstore.codecs`` entry points (``gzip = "mypkg.codecs:Gzip"``), looked up the
first time a name is not known.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.format.codecs.base import Codec

ENTRY_POINTS = "ckptstore.codecs"

_CODECS: dict[str, type[Codec]] = {}
_FORM = re.compile(r"([a-z][a-z0-9_.-]*)(?::(.*))?")


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Make ``cls`` known by its ``name`` (usable as a class decorator); `ConfigError` if
    another class holds that name."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise ConfigError(f"register_codec: expected a Codec subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _FORM.fullmatch(name) or ":" in name or name == "none":
        raise ConfigError(f"register_codec: {cls.__name__} has no usable name ({name!r})")
    held = _CODECS.setdefault(name, cls)
    if held is not cls:
        raise ConfigError(f"codec name {name!r} is already {held.__module__}.{held.__name__}")
    return cls


def known() -> list[str]:
    """The names of the codecs registered so far."""
    return sorted(_CODECS)


def _lookup(name: str) -> type[Codec] | None:
    if name not in _CODECS:
        for point in entry_points(group=ENTRY_POINTS, name=name):
            loaded = point.load()
            if _CODECS.get(name) is not loaded:
                register_codec(loaded)
    return _CODECS.get(name)


def parse_codec(value: Any, *, what: str = "codec") -> Codec | None:
    """A codec from its typed form (a `Codec`, None) or its string form (``"none"``,
    ``"zstd"``, ``"zstd:<level>"``); `ConfigError` naming ``what`` for anything else."""
    if value is None or isinstance(value, Codec):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"{what}: a codec is 'none', 'zstd:<level>' or ckptstore.Zstd(level), "
            f"got {value!r} (a {type(value).__name__})"
        )
    text = value.strip().lower()
    if text in ("none", "raw", ""):
        return None
    match = _FORM.fullmatch(text)
    cls = _lookup(match.group(1)) if match else None
    if match is None or cls is None:
        names = ", ".join(repr(f"{n}:<argument>") for n in known())
        raise ConfigError(f"{what}: unknown codec {value!r} (known: 'none', {names})")
    try:
        return cls.from_argument(match.group(2))
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def codec_name(codec: Codec | None) -> str:
    """The string form of ``codec`` (``"none"`` for raw), as manifests and `info` show it."""
    return "none" if codec is None else str(codec)


def stored_codec(value: Any, leaf: str) -> Codec | None:
    """A codec as a manifest records it (``"zstd:<level>"``; absent: raw), checked:
    ValueError naming the leaf (the manifest's parser reports it as corruption)."""
    if value is None:
        return None
    if not isinstance(value, str) or value in ("none", "raw", ""):
        raise ValueError(f"leaf {leaf!r}: bad codec {str(value)[:40]!r}")
    try:
        return parse_codec(value, what=f"leaf {leaf!r}")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
