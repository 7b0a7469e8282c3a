"""Codecs per leaf: how a leaf's chunks are compressed, and the policy that picks them.

A leaf is stored raw (the zarr3 ``bytes`` codec then ``crc32c``, what ckptstore always
wrote) or through a codec (``bytes``, then the codec, then ``crc32c``: the order zarr3
requires, array->bytes then bytes->bytes codecs; the checksum covers the stored bytes).

- `base.py`: what a codec is (`Codec`: its zarr3 entry, its coders of the chunks ckptstore
  handles itself, its string form);
- `registry.py`: the codecs known by name (`register_codec`, and packages' ``ckptstore.codecs``
  entry points), and the string forms (`parse_codec`, `codec_name`, `stored_codec`);
- `zstd.py`: zstd, Orbax's codec, the one ckptstore ships; a second codec is one module more;
- `policy.py`: `CodecPolicy`, which codec each leaf of a save gets.

A leaf's codec is a `Codec` or None (raw); the default policy compresses nothing.
"""

from ckptstore.format.codecs.base import Codec
from ckptstore.format.codecs.policy import CodecPolicy, pattern_rules
from ckptstore.format.codecs.registry import (
    codec_name,
    known,
    parse_codec,
    register_codec,
    stored_codec,
)
from ckptstore.format.codecs.zstd import Zstd

__all__ = [
    "Codec",
    "CodecPolicy",
    "Zstd",
    "codec_name",
    "known",
    "parse_codec",
    "pattern_rules",
    "register_codec",
    "stored_codec",
]
