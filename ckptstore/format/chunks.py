"""ckptstore's zarr3 chunks, encoded and decoded in Python: the raw-key path.

Every leaf is a zarr3 array whose chunks are the ``bytes`` codec's little-endian
C-order bytes (compressed by the leaf's codec, if it has one: `ckptstore.format.codecs`)
followed by the ``crc32c`` codec's checksum of the stored bytes. TensorStore reads and
writes them, but at a cost that dominates two workloads, so ckptstore handles the
keys itself there:

- small leaves: opening a TensorStore array costs about a third of a millisecond
  and a few GIL round trips, and a tree of thousands of small leaves (biases,
  norms, optimizer statistics) spends most of its save and restore in opens. A
  leaf that is one small chunk is written and read here as two keys (its
  ``zarr.json``, the very document TensorStore writes for the same spec, and its
  chunk), in batches;
- restores: the ``crc32c`` package checks checksums over twenty times faster than
  TensorStore's own check on this project's machines (and without holding the GIL: worker threads
  check chunks side by side while the event loop and the training loop run), so
  restores read chunks here too, once the leaf's ``zarr.json`` is byte for byte
  what a save writes.

The stored keys are exactly what TensorStore writes, so every reader
(TensorStore, the merge's validation, `verify`, other zarr3 tools) sees an
ordinary zarr3 array; anything unusual is left to TensorStore's own reader.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import crc32c
import numpy as np
import tensorstore as ts

from ckptstore.errors import CorruptCheckpointError
from ckptstore.format.codecs import Codec
from ckptstore.format.leaves import LeafInfo, dtype_of, zarr_spec
from ckptstore.runtime.hostpool import aligned_empty

#: Leaves up to this size whose array is a single chunk are written as raw keys. Above
#: it an open's fixed cost is small next to the write, and TensorStore avoids a copy.
MAX_SMALL_BYTES = 4 << 20
_CRC_BYTES = 4
T = TypeVar("T")


def small(info: LeafInfo) -> bool:
    """Whether ``info``'s array is one non-empty chunk small enough for the raw-key path."""
    return info.chunk_shape == info.shape and 0 < info.nbytes <= MAX_SMALL_BYTES and known(info)


def known(info: LeafInfo) -> bool:
    """Whether this module knows the ``zarr.json`` TensorStore writes for ``info``'s dtype."""
    return _template(info.dtype, info.codec) is not None


def groups(
    leaves: Sequence[tuple[LeafInfo, T]], max_bytes: int, max_count: int = 512
) -> list[list[tuple[LeafInfo, T]]]:
    """``leaves`` in consecutive groups of at most ``max_bytes`` (unless one leaf is larger)
    and ``max_count`` leaves: each group is written or read as one batch."""
    out: list[list[tuple[LeafInfo, T]]] = []
    size = 0
    for info, value in leaves:
        if not out or len(out[-1]) >= max_count or (size + info.nbytes > max_bytes and size):
            out.append([])
            size = 0
        out[-1].append((info, value))
        size += info.nbytes
    return out


def chunk_key(info: LeafInfo, coord: Sequence[int] | None = None) -> str:
    """The key of chunk ``coord`` (default: the first) of the leaf (zarr3 default
    encoding, relative to the store)."""
    coord = coord if coord is not None else [0] * len(info.shape)
    return f"{info.name}/" + "/".join(["c", *map(str, coord)])


def metadata_key(info: LeafInfo) -> str:
    return f"{info.name}/zarr.json"


def as_written(info: LeafInfo, meta: bytes | bytearray | np.ndarray[Any, Any]) -> bool:
    """Whether a stored ``zarr.json`` is byte for byte what a save writes for ``info``: then
    its shape, dtype and codecs are known without parsing it (~2 us instead of ~17 us)."""
    return known(info) and bytes(meta) == encode_metadata(info)


_TEMPLATES: dict[tuple[str, Codec | None], str | None] = {}
_SHAPE, _CHUNKS = '"shape":[1]', '"chunk_shape":[1]'


def encode_metadata(info: LeafInfo) -> bytes:
    """The ``zarr.json`` TensorStore writes for ``info`` (see `ckptstore.format.leaves.zarr_spec`).

    TensorStore itself writes one document per dtype (into a private memory store,
    once per process) for a shape of ``[1]``; leaves differ only in their shape and
    chunk shape, which are put in its place.
    """
    template = _template(info.dtype, info.codec)
    assert template is not None, "encode_metadata of a dtype this module does not know"
    shape = "[" + ",".join(map(str, info.shape)) + "]"
    chunks = "[" + ",".join(map(str, info.chunk_shape)) + "]"
    text = template.replace(_SHAPE, '"shape":' + shape, 1)
    return text.replace(_CHUNKS, '"chunk_shape":' + chunks, 1).encode()


def _template(dtype: str, codec: Codec | None = None) -> str | None:
    """TensorStore's ``zarr.json`` for ``dtype``, ``codec`` and shape ``[1]``; None if it is
    not the document this module knows how to adapt (then such leaves take TensorStore's
    path)."""
    key = (dtype, codec)
    if key not in _TEMPLATES:
        _TEMPLATES[key] = _probe(dtype, codec)
    return _TEMPLATES[key]


def _probe(dtype: str, codec: Codec | None) -> str | None:
    probe = LeafInfo("t", (1,), dtype, (1,), "numpy", codec=codec)
    ctx = ts.Context()
    ts.open(zarr_spec({"driver": "memory"}, probe), create=True, context=ctx).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    text: str = kv.read("t/zarr.json").result().value.decode()
    return text if text.count(_SHAPE) == 1 and text.count(_CHUNKS) == 1 else None


def encode_chunk(info: LeafInfo, data: np.ndarray[Any, Any]) -> bytes:
    """The stored chunk: the array's little-endian C-order bytes (compressed by
    ``info.codec``), then their crc32c."""
    raw, crc = chunk_parts(info, data)
    return b"".join((raw, crc))  # one copy


def encode_region(info: LeafInfo, part: np.ndarray[Any, Any]) -> bytes:
    """`encode_chunk` of ``part``, one chunk's region of the leaf: an edge chunk (smaller
    than the chunk shape) padded with zeros, the fill value, as zarr3 stores it."""
    if part.shape != tuple(info.chunk_shape):
        padded = np.zeros(info.chunk_shape, dtype_of(info.dtype))
        padded[tuple(slice(0, n) for n in part.shape)] = part
        part = padded
    return encode_chunk(info, part)


def chunk_parts(info: LeafInfo, data: np.ndarray[Any, Any]) -> tuple[memoryview, bytes]:
    """The stored chunk as its two parts, without copying ``data`` where it already is
    little-endian and C-contiguous and ``info`` has no codec: its (compressed) bytes, and
    their crc32c. Its length is ``len(first) + 4``, `stored_size` for a raw leaf."""
    arr = np.ascontiguousarray(data, dtype=_little(dtype_of(info.dtype)))
    raw = arr.reshape(-1).view(np.uint8)
    if info.codec is not None:
        packed = np.frombuffer(info.codec.encode(raw.data), np.uint8)
        return packed.data, checksum(packed)
    return raw.data, checksum(raw)


def stored_size(info: LeafInfo) -> int:
    """Bytes of a stored chunk of a raw ``info`` (its data and checksum); of a compressed
    one, the most a chunk may hold (what a reader may allocate for one)."""
    size = math.prod(info.chunk_shape) * dtype_of(info.dtype).itemsize
    if info.codec is not None:
        size = info.codec.bound(size)
    return size + _CRC_BYTES


def raw_size(info: LeafInfo) -> int:
    """Bytes of one chunk of ``info``'s data, uncompressed."""
    return math.prod(info.chunk_shape) * dtype_of(info.dtype).itemsize


def decode_chunk(
    info: LeafInfo,
    stored: bytes | np.ndarray[Any, Any],
    *,
    copy: bool = True,
    key: str | None = None,
) -> np.ndarray[Any, Any]:
    """A chunk's array (``info.chunk_shape``) from its stored bytes; a wrong size or
    checksum is corruption, named by the chunk's ``key`` where given. ``copy=False``
    returns a view of ``stored`` (read-only for bytes; for an aligned writable buffer, one
    devices can adopt as it is)."""
    dtype = dtype_of(info.dtype)
    whole = np.frombuffer(stored, np.uint8)
    chunk = f"chunk {key}" if key else "chunk"
    if info.codec is not None:
        return _decode_compressed(info, whole, chunk)
    size = raw_size(info)
    if whole.size != size + _CRC_BYTES:
        raise CorruptCheckpointError(
            f"{chunk} holds {whole.size} bytes, {size + _CRC_BYTES} expected", leaf=info.name
        )
    raw = whole[:size]
    if checksum(raw) != whole[size:].tobytes():
        raise CorruptCheckpointError(f"{chunk}: checksum (crc32c) mismatch", leaf=info.name)
    arr = raw.view(_little(dtype)).reshape(info.chunk_shape)
    if not copy:
        return arr.astype(dtype, copy=False)
    out = aligned_empty(info.chunk_shape, dtype)
    np.copyto(out, arr)
    return out


def _decode_compressed(
    info: LeafInfo, whole: np.ndarray[Any, Any], chunk: str = "chunk"
) -> np.ndarray[Any, Any]:
    """`decode_chunk` of a compressed chunk: checksum of the stored bytes, then the frame
    decompressed into an aligned buffer of its own."""
    if not _CRC_BYTES < whole.size <= stored_size(info):
        raise CorruptCheckpointError(
            f"compressed {chunk} holds {whole.size} bytes, at most {stored_size(info)} expected",
            leaf=info.name,
        )
    packed = whole[: whole.size - _CRC_BYTES]
    if checksum(packed) != whole[packed.size :].tobytes():
        raise CorruptCheckpointError(f"{chunk}: checksum (crc32c) mismatch", leaf=info.name)
    dtype, codec = dtype_of(info.dtype), info.codec
    assert codec is not None
    out = aligned_empty(info.chunk_shape, dtype)
    stored_as = _little(dtype)
    if stored_as == dtype:  # decoded where it stays
        codec.decode_into(packed.data, out, info.name)
        return out
    little = np.empty(info.chunk_shape, stored_as)  # a big-endian dtype: swapped after
    codec.decode_into(packed.data, little, info.name)
    np.copyto(out, little)
    return out


def checksum(data: np.ndarray[Any, np.dtype[np.uint8]]) -> bytes:
    """The zarr3 ``crc32c`` codec's checksum of ``data``'s bytes (4 bytes, little-endian).

    ``crc32c`` releases the GIL for buffers of 32 KiB and more, so checksums on worker
    threads run beside Python work elsewhere in the process."""
    return int(crc32c.crc32c(data.data)).to_bytes(_CRC_BYTES, "little")


def _little(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
