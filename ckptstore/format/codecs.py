"""Codecs per leaf: how a leaf's chunks are compressed, and the policy that picks them.

A leaf is stored raw (the zarr3 ``bytes`` codec then ``crc32c``, what ckptstore always
wrote) or compressed with zstd at a level (``bytes``, then ``zstd``, then ``crc32c``: the
order zarr3 requires, array->bytes then bytes->bytes codecs; the checksum covers the
compressed bytes). Orbax writes its zarr3 arrays with zstd too, so a compressed leaf is
an ordinary zarr3 array to TensorStore, Orbax and other zarr3 readers.

The typed form of a codec is `Zstd` (or None: raw); the string form, for profiles and
manifests, is ``"none"``, ``"zstd"`` (level 3) or ``"zstd:<level>"`` (`parse_codec`,
`codec_name`). A `CodecPolicy` chooses one per leaf, by glob patterns on the leaf's name
(as ckptstore names leaves: ``params/dense/kernel``) or by a callable; `CodecPolicy.of`
accepts every form ``save(..., codecs=...)``, `ManagerOptions` and profiles take.

Compression here (`compress`, `decompress`) is the ``zstandard`` package's: ckptstore
encodes and decodes the chunks it handles itself (small leaves, packs, raw-chunk
restores) with it; TensorStore compresses the big leaves it writes with its own zstd.
Both write standard zstd frames, so either reads the other's.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, Union

import numpy as np
import zstandard

from ckptstore.errors import ConfigError, CorruptCheckpointError

T = TypeVar("T")

if TYPE_CHECKING:
    from ckptstore.format.leaves import LeafInfo

#: zstd's levels that ckptstore accepts (zstd's own range, less its "fast" negative ones).
MIN_LEVEL, MAX_LEVEL = 1, 22
#: Orbax's default level, and ``"zstd"``'s.
DEFAULT_LEVEL = 3


@dataclass(frozen=True)
class Zstd:
    """zstd compression at ``level`` (1 to 22; 3, Orbax's default, unless given)."""

    level: int = DEFAULT_LEVEL

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise ConfigError(f"zstd level must be an integer, got {self.level!r}")
        if not MIN_LEVEL <= self.level <= MAX_LEVEL:
            raise ConfigError(f"zstd level must be {MIN_LEVEL} to {MAX_LEVEL}, got {self.level}")

    def __str__(self) -> str:
        return f"zstd:{self.level}"

    def zarr_codec(self) -> dict[str, Any]:
        """The zarr3 codec entry (what TensorStore and Orbax write for zstd)."""
        return {"name": "zstd", "configuration": {"level": self.level, "checksum": False}}


#: A leaf's codec: None is raw (no compression).
Codec = Union[Zstd, None]  # noqa: UP007 (a runtime alias: `Zstd | None` is a types.UnionType)

_NAME = re.compile(r"zstd(?::(-?\d{1,6}))?")


def parse_codec(value: Any, *, what: str = "codec") -> Codec:
    """A codec from its typed form (`Zstd`, None) or its string form (``"none"``,
    ``"zstd"``, ``"zstd:<level>"``); `ConfigError` naming ``what`` for anything else."""
    if value is None or isinstance(value, Zstd):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"{what}: a codec is 'none', 'zstd:<level>' or ckptstore.Zstd(level), "
            f"got {value!r} (a {type(value).__name__})"
        )
    text = value.strip().lower()
    if text in ("none", "raw", ""):
        return None
    match = _NAME.fullmatch(text)
    if match is None:
        raise ConfigError(f"{what}: unknown codec {value!r} (known: 'none', 'zstd:<level>')")
    try:
        return Zstd(int(match.group(1)) if match.group(1) else DEFAULT_LEVEL)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def codec_name(codec: Codec) -> str:
    """The string form of ``codec`` (``"none"`` for raw), as manifests and `info` show it."""
    return "none" if codec is None else str(codec)


def stored_codec(value: Any, leaf: str) -> Codec:
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


# ---- the policy ----

Chooser = Callable[[str, "LeafInfo"], Any]


@dataclass(frozen=True)
class CodecPolicy:
    """Which codec each leaf of a save gets.

    ``rules``: ``(pattern, codec)`` pairs, tried in order; the first whose glob pattern
    (`fnmatch.fnmatchcase`: ``*`` also matches ``/``) matches the leaf's name decides.
    ``choose``: a callable ``(name, info) -> codec`` (`Zstd`, None or a string form),
    asked for leaves no rule matched. ``default``: the codec of every other leaf.
    The default policy compresses nothing: a save writes exactly the bytes it always did.
    """

    rules: tuple[tuple[str, Codec], ...] = ()
    choose: Chooser | None = None
    default: Codec = None

    @property
    def empty(self) -> bool:
        """Whether every leaf is stored raw, whatever its name."""
        return (
            self.default is None and self.choose is None and all(c is None for _, c in self.rules)
        )

    def codec_for(self, info: LeafInfo) -> Codec:
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
        if spec is None or isinstance(spec, (str, Zstd)):
            return cls(default=parse_codec(spec, what=what))
        if isinstance(spec, Mapping):
            return cls(rules=pattern_rules(spec, parse_codec, what))
        if callable(spec):
            return cls(choose=spec)
        raise ConfigError(
            f"{what}: expected a codec, a {{pattern: codec}} mapping or a callable, "
            f"got {type(spec).__name__}"
        )


# ---- compression ----

_local = threading.local()  # zstandard's contexts are not thread-safe: one per thread


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


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    if level not in cache:
        # No frame checksum (the zarr3 crc32c codec checks the bytes), the content size
        # in the frame header (as TensorStore writes it).
        cache[level] = zstandard.ZstdCompressor(
            level=level, write_checksum=False, write_content_size=True
        )
    return cache[level]


def compress(codec: Zstd, data: Any) -> bytes:
    """``data`` (a buffer) compressed as one zstd frame; releases the GIL meanwhile."""
    return _compressor(codec.level).compress(data)


def decompress_into(data: Any, out: np.ndarray[Any, Any], leaf: str) -> None:
    """Fill ``out`` (a C-contiguous array) with the zstd frame ``data``, which must hold
    exactly its size; anything else (not zstd, a frame of another size) is
    `CorruptCheckpointError` naming ``leaf``. A frame header claiming another size is
    refused before anything is written. The frame is decoded straight into ``out``: no
    buffer of its own, no copy (a restore's chunk is decoded where the devices take it)."""
    dest = out.reshape(-1).view(np.uint8).data  # any dtype, bfloat16 too: as bytes
    size = dest.nbytes
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "d", None)
    if dctx is None:
        dctx = _local.d = zstandard.ZstdDecompressor()
    try:
        claimed = zstandard.get_frame_parameters(data).content_size
        if claimed not in (size, zstandard.CONTENTSIZE_UNKNOWN):
            raise CorruptCheckpointError(
                f"chunk's zstd frame holds {claimed} bytes, {size} expected", leaf=leaf
            )
        with dctx.stream_reader(data, read_size=max(len(data), 1)) as reader:
            filled = 0
            while filled < size and (got := reader.readinto(dest[filled:])):
                filled += got
            more = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"chunk does not decompress (zstd): {exc}", leaf=leaf) from exc
    if filled != size or more:
        held = f"more than {size}" if more else str(filled)
        raise CorruptCheckpointError(
            f"chunk decompresses to {held} bytes, {size} expected", leaf=leaf
        )
