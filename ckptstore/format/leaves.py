"""The leaf schema: what the manifest records about each leaf, and how it is chunked.

A leaf is a jax array, a numpy array or scalar, or a Python number. `describe_leaf`
turns one into a `LeafInfo` (shape, dtype, chunk shape, kind, sharding) before any
byte is written, so unsupported leaves are refused up front. The TensorStore I/O
that uses this schema is in `ckptstore.datapath.arrays`.

A typed PRNG key array (``jax.random.key(0)``, any implementation) is stored as its
key data (`jax.random.key_data`: uint32, the key shape plus the implementation's
trailing dimensions) with the implementation's name in `LeafInfo.prng_impl`; restore
wraps the data again (`jax.random.wrap_key_data`) into keys of that implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from ckptstore.errors import UnsupportedLeafError
from ckptstore.format.codecs import Codec, stored_codec

#: Chunks are split until they are at most this big, so resharded reads stay cheap.
TARGET_CHUNK_BYTES = 64 << 20

T = TypeVar("T")


class _computed_once(Generic[T]):
    """A read-only attribute computed on first use and then kept in the instance's
    ``__dict__`` (`functools.cached_property` without Python 3.11's lock, which every
    first use takes: a tenth of the time a manifest of thousands of leaves took to parse)."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _computed_once[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True)
class LeafInfo:
    """What the manifest records about one leaf."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    kind: str  # "jax" | "numpy" | "scalar"
    python_type: str | None = None  # "int" | "float" | "bool" | "complex" for Python numbers
    sharding: dict[str, Any] | None = None
    #: A typed PRNG key leaf: its implementation's name (``"threefry2x32"``, ``"rbg"``...).
    #: Shape, dtype and chunks are then those of the key data (`jax.random.key_data`).
    prng_impl: str | None = None
    #: How its chunks are compressed (`ckptstore.format.codecs`); None: raw.
    codec: Codec | None = None
    #: The dtype the leaf had before a save stored it as ``dtype`` (a lossy cast asked for:
    #: `ckptstore.format.casts`); a restore gives it back in this dtype. None: not cast.
    cast_from: str | None = None

    @_computed_once
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        out = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "kind": self.kind,
            "python_type": self.python_type,
            "sharding": self.sharding,
            "nbytes": self.nbytes,
        }
        if self.prng_impl is not None:  # only on key leaves: other records stay as they were
            out["prng_impl"] = self.prng_impl
        if self.codec is not None:  # raw leaves' records stay as they were
            out["codec"] = str(self.codec)
        if self.cast_from is not None:
            out["cast_from"] = self.cast_from
        return out

    def with_codec(self, codec: Codec | None) -> LeafInfo:
        """This leaf stored with ``codec``."""
        return dataclasses.replace(self, codec=codec)

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> LeafInfo:
        return cls(
            name=name,
            shape=tuple(data["shape"]),
            dtype=data["dtype"],
            chunk_shape=tuple(data["chunk_shape"]),
            kind=data["kind"],
            python_type=data.get("python_type"),
            sharding=data.get("sharding"),
            prng_impl=data.get("prng_impl"),
            codec=stored_codec(data.get("codec"), name),
            cast_from=data.get("cast_from"),
        )


def zarr_spec(kvstore: dict[str, Any], info: LeafInfo) -> dict[str, Any]:
    """The TensorStore spec of one leaf's zarr3 array below ``kvstore``."""
    return {
        "driver": "zarr3",
        "kvstore": {**kvstore, "path": kvstore.get("path", "") + info.name + "/"},
        "metadata": {
            "shape": list(info.shape),
            "data_type": info.dtype,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": list(info.chunk_shape)},
            },
            # The array->bytes codec, then the bytes->bytes ones (zarr3's order): the
            # checksum covers the stored (compressed) bytes.
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                *([info.codec.zarr_codec()] if info.codec is not None else []),
                {"name": "crc32c"},
            ],
        },
        # Write every chunk, even all-zero ones, so validation can demand each chunk exists.
        "store_data_equal_to_fill_value": True,
    }


# ---- dtypes and chunking ----


@functools.lru_cache(maxsize=256)
def dtype_of(name: str) -> np.dtype[Any]:
    """The numpy dtype for a stored dtype name (ml_dtypes names included)."""
    try:
        return np.dtype(ts.dtype(name).numpy_dtype)
    except (ValueError, TypeError) as exc:
        raise UnsupportedLeafError(f"dtype {name!r} is not supported") from exc


def dtype_name(dtype: Any) -> str:
    return _stored_name(np.dtype(dtype))


@functools.lru_cache(maxsize=256)
def _stored_name(dtype: np.dtype[Any]) -> str:
    # Cached: numpy builds a dtype's name anew on every access (~5 us a leaf).
    name: str = dtype.name
    try:
        ts.dtype(name)
    except (ValueError, TypeError) as exc:
        raise UnsupportedLeafError(f"dtype {name!r} cannot be stored by TensorStore") from exc
    return name


def choose_chunks(shard_shape: Sequence[int], itemsize: int, target: int) -> tuple[int, ...]:
    """Chunk shape: the shard, split along its largest dimensions until under ``target`` bytes.

    Chunks divide the shard exactly, so every shard is written as whole chunks
    (no read-modify-write) and a reader on another mesh reads few extra bytes.
    """
    chunk = [max(1, d) for d in shard_shape]
    while math.prod(chunk) * itemsize > target:
        candidates = [i for i, d in enumerate(chunk) if d > 1]
        if not candidates:
            break
        dim = max(candidates, key=lambda i: chunk[i])
        chunk[dim] //= _smallest_factor(chunk[dim])
    return tuple(chunk)


def _smallest_factor(n: int) -> int:
    for f in range(2, math.isqrt(n) + 1):
        if n % f == 0:
            return f
    return n


# ---- describing leaves ----


def sharding_json(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return {
            "type": "named",
            "mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()},
            "spec": spec,
        }
    return {"type": type(sharding).__name__, "repr": repr(sharding)[:500]}


Index = tuple[slice, ...]


@dataclass(frozen=True)
class HostShards:
    """A jax array as staged for a save: the shards this process writes (addressable,
    replica 0), copied into host memory that only the save uses, or (CPU devices)
    zero-copy views that keep the shards' own buffers alive and unchanged; either way
    the array itself may be donated, deleted or overwritten as soon as staging returns.
    ``extra``: the other addressable slices (replicas whose replica 0 is on another
    process), staged for a host-local fast tier's copy
    (`ckptstore.datapath.arrays.host_view_slices`); None when not staged."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sharding: jax.sharding.Sharding
    pieces: tuple[tuple[Index, np.ndarray[Any, Any]], ...]
    extra: tuple[tuple[Index, np.ndarray[Any, Any]], ...] | None = None
    #: Staged from a typed PRNG key array: its implementation (`key_impl_name`); the
    #: shape, dtype, sharding and pieces are then its key data's.
    prng_impl: str | None = None


@functools.lru_cache(maxsize=256)
def _is_key_dtype(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


def is_key_array(value: Any) -> bool:
    """Whether ``value`` is a typed PRNG key array (``jax.random.key``, not key data)."""
    return isinstance(value, jax.Array) and _is_key_dtype(value.dtype)


def is_key_like(value: Any) -> bool:
    """Whether ``value`` (an array or a `jax.ShapeDtypeStruct`) has a typed PRNG key dtype."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and _is_key_dtype(dtype)


@functools.lru_cache(maxsize=64)
def key_impl_name(dtype: Any) -> str:
    """The name of a typed key dtype's implementation, as ``jax.random.key(seed, impl=...)``
    takes it; `UnsupportedLeafError` for an implementation that cannot be named so
    (one made with ``jax.extend.random.define_prng_impl`` and never registered)."""
    # jax.random.key_impl needs an array, not a dtype (a `ShapeDtypeStruct` has only that).
    name = getattr(getattr(dtype, "_impl", None), "name", None)
    if isinstance(name, str):
        try:
            if jax.eval_shape(functools.partial(jax.random.key, 0, impl=name)).dtype == dtype:
                return name
        except (ValueError, TypeError):
            pass
    raise UnsupportedLeafError(
        f"typed PRNG keys of dtype {dtype} cannot be saved: their implementation is not "
        "registered by name in jax"
    )


@functools.lru_cache(maxsize=64)
def key_data_aval(impl: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The trailing shape and the dtype of one key's data for the implementation ``impl``;
    `UnsupportedLeafError` for a name this jax does not know."""
    try:
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    except (ValueError, TypeError, KeyError) as exc:
        raise UnsupportedLeafError(
            f"PRNG implementation {impl!r} is unknown to this jax ({jax.__version__})"
        ) from exc
    return tuple(data.shape), np.dtype(data.dtype)


def storable(value: Any) -> Any:
    """What is written for a leaf: a typed PRNG key array's data, else the value itself."""
    return jax.random.key_data(value) if is_key_array(value) else value


def describe_leaf(name: str, value: Any, target_chunk: int = TARGET_CHUNK_BYTES) -> LeafInfo:
    """The `LeafInfo` for one leaf value (of a typed PRNG key array: of its key data,
    with the implementation's name; write `storable(value)`)."""
    if is_key_array(value):
        info = describe_leaf(name, jax.random.key_data(value), target_chunk)
        return dataclasses.replace(info, prng_impl=key_impl_name(value.dtype))
    if isinstance(value, (jax.Array, HostShards)):
        dtype = dtype_name(value.dtype)
        shard_shape = value.sharding.shard_shape(value.shape)
        return LeafInfo(
            name=name,
            shape=tuple(value.shape),
            dtype=dtype,
            chunk_shape=choose_chunks(shard_shape, value.dtype.itemsize, target_chunk),
            kind="jax",
            sharding=sharding_json(value.sharding),
            prng_impl=value.prng_impl if isinstance(value, HostShards) else None,
        )
    python_type = None
    if type(value) in (bool, int, float, complex):  # np.float64 is a float too: not this
        python_type = type(value).__name__
        if type(value) is int and not -(2**63) <= value < 2**63:
            raise UnsupportedLeafError(f"leaf {name!r}: int {value} does not fit in int64")
    if python_type or isinstance(value, (np.ndarray, np.generic)):
        arr = host_array(value)
        return LeafInfo(
            name=name,
            shape=tuple(arr.shape),
            dtype=dtype_name(arr.dtype),
            chunk_shape=choose_chunks(arr.shape, arr.dtype.itemsize, target_chunk),
            kind="scalar" if python_type or isinstance(value, np.generic) else "numpy",
            python_type=python_type,
        )
    raise UnsupportedLeafError(f"leaf {name!r} has unsupported type {type(value).__name__}")


def host_array(value: Any) -> np.ndarray[Any, Any]:
    """A numpy array for a host leaf; Python ints are stored as int64 on every platform."""
    return np.asarray(value, dtype=np.int64 if type(value) is int else None)


def cast_value(value: Any, dtype: str) -> Any:
    """``value`` (a jax array, a staged `HostShards`, a numpy array) converted to ``dtype``
    for a lossy cast (`ckptstore.format.casts`): a new array of the narrower dtype (a jax
    array's on its devices, with its sharding; a staged array's pieces on the host)."""
    target = dtype_of(dtype)
    if isinstance(value, jax.Array):
        return value.astype(target)
    if isinstance(value, HostShards):
        extra = value.extra
        return dataclasses.replace(
            value,
            dtype=target,
            pieces=tuple((i, np.asarray(d).astype(target)) for i, d in value.pieces),
            extra=None
            if extra is None
            else tuple((i, np.asarray(d).astype(target)) for i, d in extra),
        )
    return np.asarray(value).astype(target)
