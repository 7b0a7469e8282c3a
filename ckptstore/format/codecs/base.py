"""What a codec is: the bytes->bytes step a leaf's chunks pass through between the zarr3
``bytes`` codec and the ``crc32c`` checksum.

A codec has two coders of its chunks. TensorStore compresses and decompresses the leaves it
writes and reads (the big ones) from the zarr3 entry `Codec.zarr_codec` returns, so that entry
must name a codec TensorStore's zarr3 driver implements; ckptstore codes the chunks it handles
itself (small leaves, packs, raw-chunk restores) with `Codec.encode` and `Codec.decode_into`,
which must write and read the same bytes. Both stand in the codec's own module
(`ckptstore.format.codecs.zstd` is the model) and `register_codec` makes its name known to
profiles, manifests and the command line.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np


class Codec(abc.ABC):
    """One codec at its settings; a frozen dataclass in practice (compared and hashed by
    value: a leaf's codec is part of what an incremental save compares)."""

    #: The name of its string form (``"<name>"`` or ``"<name>:<argument>"``).
    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def from_argument(cls, argument: str | None) -> Codec:
        """The codec a string form's argument (the text after ``"<name>:"``, None where
        there is none) describes; `ckptstore.errors.ConfigError` for a bad one."""

    @abc.abstractmethod
    def __str__(self) -> str:
        """Its string form, as manifests record it: `from_argument` reads it back."""

    @abc.abstractmethod
    def zarr_codec(self) -> dict[str, Any]:
        """Its zarr3 codec entry (``{"name": ..., "configuration": {...}}``)."""

    @abc.abstractmethod
    def encode(self, data: Any) -> bytes:
        """``data`` (a buffer of a chunk's little-endian bytes) as the codec stores it."""

    @abc.abstractmethod
    def decode_into(self, data: Any, out: np.ndarray[Any, Any], leaf: str) -> None:
        """Fill ``out`` (C-contiguous) with the stored chunk ``data``, which must hold exactly
        its size; anything else is `ckptstore.errors.CorruptCheckpointError` naming ``leaf``."""

    def bound(self, size: int) -> int:
        """The most bytes a chunk of ``size`` raw bytes may take stored (what a reader may
        allocate for one); generous by default, as incompressible data grows a little."""
        return size + (size >> 7) + 1024
