"""Arrays <-> TensorStore zarr3 arrays inside OCDBT stores.

Each leaf is a zarr3 array whose chunks carry a ``crc32c`` checksum that
TensorStore verifies on every read. A process writes only the shards it owns
(addressable, replica 0) into its own OCDBT store; reads fetch only the slices
each device needs, whatever mesh the arrays were saved from.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ckptstore.errors import CkptStoreError, CorruptCheckpointError

#: Chunks are split until they are at most this big, so resharded reads stay cheap.
TARGET_CHUNK_BYTES = 64 << 20
#: Bytes of host copies of shard data a process hands to TensorStore at once; bounds a
#: save's memory. Shards already in host memory (CPU devices) are passed without a copy.
MAX_INFLIGHT_BYTES = 256 << 20
#: OCDBT starts writing a data file once it holds this many bytes, so a save's data files
#: are written (and fsync'd) in parallel while later chunks are still being encoded,
#: instead of one big file per commit (TensorStore's default target is 2 GiB).
DATA_FILE_BYTES = 64 << 20

Index = tuple[slice, ...]


class UnsupportedLeafError(CkptStoreError, TypeError):
    """A leaf's type or dtype cannot be stored."""


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

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(dtype_of(self.dtype)).itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "kind": self.kind,
            "python_type": self.python_type,
            "sharding": self.sharding,
            "nbytes": self.nbytes,
        }

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
        )


@dataclass
class WriteStats:
    """What one process wrote in one save."""

    process: int
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    leaves: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "shards": self.shards,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
        }


# ---- dtypes and chunking ----


def dtype_of(name: str) -> np.dtype[Any]:
    """The numpy dtype for a stored dtype name (ml_dtypes names included)."""
    try:
        return np.dtype(ts.dtype(name).numpy_dtype)
    except (ValueError, TypeError) as exc:
        raise UnsupportedLeafError(f"dtype {name!r} is not supported") from exc


def dtype_name(dtype: Any) -> str:
    name: str = np.dtype(dtype).name
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
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
        # Write every chunk, even all-zero ones, so validation can demand each chunk exists.
        "store_data_equal_to_fill_value": True,
    }


def ocdbt_spec(base: dict[str, Any]) -> dict[str, Any]:
    """An OCDBT store on top of a backend's kvstore spec."""
    return {"driver": "ocdbt", "base": base, "target_data_file_size": DATA_FILE_BYTES}


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


def describe_leaf(name: str, value: Any, target_chunk: int = TARGET_CHUNK_BYTES) -> LeafInfo:
    """The `LeafInfo` for one leaf value."""
    if isinstance(value, jax.Array):
        dtype = dtype_name(value.dtype)
        shard_shape = value.sharding.shard_shape(value.shape)
        return LeafInfo(
            name=name,
            shape=tuple(value.shape),
            dtype=dtype,
            chunk_shape=choose_chunks(shard_shape, value.dtype.itemsize, target_chunk),
            kind="jax",
            sharding=sharding_json(value.sharding),
        )
    python_type = None
    if isinstance(value, (bool, int, float, complex)):
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


def owned_slices(value: Any, process: int) -> list[tuple[Index, Any]]:
    """The (index, data) pieces of a leaf that ``process`` must write.

    jax arrays: the addressable shards with replica id 0. Host values belong
    to process 0. Data is returned lazily for jax shards (``shard.data``).
    """
    if isinstance(value, jax.Array):
        return [
            (tuple(shard.index), shard.data)
            for shard in value.addressable_shards
            if shard.replica_id == 0
        ]
    if process != 0:
        return []
    arr = host_array(value)
    return [(tuple(slice(None) for _ in arr.shape), arr)]


# ---- writing ----


async def write_leaves(
    store: dict[str, Any],
    context: ts.Context,
    leaves: Sequence[tuple[LeafInfo, Any]],
    *,
    process: int,
    write_metadata: bool,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
) -> WriteStats:
    """Write this process's pieces of ``leaves`` into the OCDBT store ``store``.

    ``write_metadata`` makes this process write every leaf's ``zarr.json``
    (exactly one process should). At most ``max_inflight_bytes`` of shard data
    are handed to TensorStore at a time, which bounds the memory a save adds.
    """
    stats = WriteStats(process=process)
    start = time.perf_counter()
    budget = _ByteBudget(max_inflight_bytes)

    async def one_leaf(info: LeafInfo, value: Any) -> None:
        pieces = owned_slices(value, process)
        if not pieces and not write_metadata:
            return
        if write_metadata:
            arr = await ts.open(zarr_spec(store, info), create=True, context=context)
        else:  # the metadata comes from process 0; only chunks are written here
            arr = await ts.open(
                zarr_spec(store, info), open=True, assume_metadata=True, context=context
            )
        if pieces:
            stats.leaves.append(info.name)
        await asyncio.gather(*(write_piece(arr, index, data) for index, data in pieces))

    async def write_piece(arr: ts.TensorStore, index: Index, data: Any) -> None:
        nbytes = math.prod(_sliced_shape(arr.shape, index)) * arr.dtype.numpy_dtype.itemsize
        view = host_view(data)
        if view is not None:  # no copy: adds no memory, so it takes no share of the budget
            await arr[index].write(view, can_reference_source_data_indefinitely=True)
        else:
            async with budget.hold(nbytes):
                host = np.asarray(data)  # device-to-host copy for jax shards
                # A jax shard's copy is private and never mutated: TensorStore may encode
                # straight from it. A numpy leaf is the caller's array: TensorStore copies it.
                await arr[index].write(
                    host, can_reference_source_data_indefinitely=isinstance(data, jax.Array)
                )
        stats.shards += 1
        stats.bytes += nbytes

    await asyncio.gather(*(one_leaf(info, value) for info, value in leaves))
    stats.seconds = time.perf_counter() - start
    return stats


def host_view(data: Any) -> np.ndarray[Any, Any] | None:
    """A numpy view of a jax shard's own buffer when it lives in host memory, else None.

    On CPU devices `np.asarray` returns a read-only view of the (immutable) device
    buffer; TensorStore can encode from it directly, with no copy at all.
    """
    if not isinstance(data, jax.Array) or any(d.platform != "cpu" for d in data.devices()):
        return None
    host = np.asarray(data)
    try:
        shared = host.size > 0 and host.ctypes.data == data.unsafe_buffer_pointer()
    except Exception:  # not a single-device array, or no buffer pointer on this platform
        return None
    return host if shared else None


def _sliced_shape(shape: Sequence[int], index: Index) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True))


class _ByteBudget:
    """An async semaphore counted in bytes; one piece larger than the budget may pass alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    def hold(self, nbytes: int) -> _Hold:
        return _Hold(self, nbytes)


class _Hold:
    def __init__(self, budget: _ByteBudget, nbytes: int):
        self.budget, self.nbytes = budget, nbytes

    async def __aenter__(self) -> None:
        b = self.budget
        async with b._cond:
            await b._cond.wait_for(lambda: b.used == 0 or b.used + self.nbytes <= b.limit)
            b.used += self.nbytes

    async def __aexit__(self, *exc: object) -> None:
        b = self.budget
        async with b._cond:
            b.used -= self.nbytes
            b._cond.notify_all()


# ---- reading ----


async def open_leaf(store: dict[str, Any], context: ts.Context, info: LeafInfo) -> ts.TensorStore:
    """Open a saved leaf for reading (metadata is read and checked from storage)."""
    spec = {
        "driver": "zarr3",
        "kvstore": {**store, "path": store.get("path", "") + info.name + "/"},
    }
    try:
        arr = await ts.open(spec, open=True, read=True, context=context)
    except Exception as exc:  # TensorStore raises ValueError for most failures
        raise _read_error(exc, info.name) from exc
    if tuple(arr.shape) != info.shape or arr.dtype.name != info.dtype:
        raise CorruptCheckpointError(
            f"stored array is {arr.dtype.name}{list(arr.shape)} but the manifest says "
            f"{info.dtype}{list(info.shape)}",
            leaf=info.name,
        )
    return arr


async def read_slice(arr: ts.TensorStore, index: Index, name: str) -> np.ndarray[Any, Any]:
    try:
        return np.asarray(await arr[index].read())
    except Exception as exc:
        raise _read_error(exc, name) from exc


def _read_error(exc: Exception, name: str) -> CkptStoreError:
    text = str(exc)
    return CorruptCheckpointError(f"cannot read stored data: {text[:300]}", leaf=name)
