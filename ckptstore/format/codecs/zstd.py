"""zstd, the codec Orbax writes its zarr3 arrays with: a leaf compressed with it is an
ordinary zarr3 array to TensorStore, Orbax and other zarr3 readers.

Its string form is ``"zstd"`` (level 3, Orbax's default) or ``"zstd:<level>"``. The chunks
ckptstore codes itself are the ``zstandard`` package's frames; TensorStore compresses the
big leaves it writes with its own zstd. Both write standard zstd frames, so either reads the
other's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.format.codecs.base import Codec
from ckptstore.format.codecs.registry import register_codec

#: zstd's levels that ckptstore accepts (zstd's own range, less its "fast" negative ones).
MIN_LEVEL, MAX_LEVEL = 1, 22
#: Orbax's default level, and ``"zstd"``'s.
DEFAULT_LEVEL = 3


@register_codec
@dataclass(frozen=True)
class Zstd(Codec):
    """zstd compression at ``level`` (1 to 22; 3, Orbax's default, unless given)."""

    name = "zstd"
    level: int = DEFAULT_LEVEL

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise ConfigError(f"zstd level must be an integer, got {self.level!r}")
        if not MIN_LEVEL <= self.level <= MAX_LEVEL:
            raise ConfigError(f"zstd level must be {MIN_LEVEL} to {MAX_LEVEL}, got {self.level}")

    @classmethod
    def from_argument(cls, argument: str | None) -> Zstd:
        """``"zstd"`` (level 3) or ``"zstd:<level>"``."""
        if argument is None:
            return cls()
        text = argument.strip()
        if not text.lstrip("-").isdigit() or len(text) > 6:
            raise ConfigError(f"zstd level must be an integer, got {argument!r}")
        return cls(int(text))

    def __str__(self) -> str:
        return f"zstd:{self.level}"

    def zarr_codec(self) -> dict[str, Any]:
        """The zarr3 codec entry (what TensorStore and Orbax write for zstd)."""
        return {"name": "zstd", "configuration": {"level": self.level, "checksum": False}}

    def encode(self, data: Any) -> bytes:
        """``data`` compressed as one zstd frame; releases the GIL meanwhile."""
        return _compressor(self.level).compress(data)

    def decode_into(self, data: Any, out: np.ndarray[Any, Any], leaf: str) -> None:
        """The frame decoded straight into ``out`` (see `decompress_into`)."""
        decompress_into(data, out, leaf)

    def bound(self, size: int) -> int:
        """zstd's bound on a frame of ``size`` bytes, generously."""
        return size + (size >> 7) + 1024


_local = threading.local()  # zstandard's contexts are not thread-safe: one per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    if level not in cache:
        # No frame checksum (the zarr3 crc32c codec checks the bytes), the content size
        # in the frame header (as TensorStore writes it).
        cache[level] = zstandard.ZstdCompressor(
            level=level, write_checksum=False, write_content_size=True
        )
    return cache[level]


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
