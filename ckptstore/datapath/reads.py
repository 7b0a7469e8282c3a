"""Reading stored leaves: TensorStore arrays opened strictly, chunk values in batches.

`open_leaf` opens a saved zarr3 array with its ``zarr.json`` checked against the manifest
and missing chunks refused; `read_slice` reads one region of it; a `Chunks` source gives raw
chunk values (`KvChunks` through TensorStore's kvstore, or a direct reader of OCDBT data
files: `ckptstore.datapath.ocdbt_index`); `read_small_leaves` reads single-chunk leaves in
batches. Every failure becomes a typed error (`read_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

from ckptstore.backends.tsdeadline import bind, policy_of, within
from ckptstore.backends.tserrors import message, storage_error
from ckptstore.errors import CkptStoreError, CorruptCheckpointError
from ckptstore.format import chunks
from ckptstore.format.leaves import Index, LeafInfo, zarr_spec
from ckptstore.runtime.futures import THREAD_BYTES, off_loop, wait_all


async def open_leaf(store: dict[str, Any], context: ts.Context, info: LeafInfo) -> ts.TensorStore:
    """Open a saved leaf for reading.

    The stored ``zarr.json`` must match what the manifest implies exactly (shape,
    dtype, chunk grid, codecs), and a missing chunk is an error rather than zeros.
    """
    spec = {
        "driver": "zarr3",
        "kvstore": zarr_spec(store, info)["kvstore"],
        "metadata": zarr_spec(store, info)["metadata"],
        "fill_missing_data_reads": False,
    }
    try:
        opening = ts.open(spec, open=True, read=True, context=context)
        arr: ts.TensorStore = await within(opening, context, 0, f"opening leaf {info.name!r}")
    except Exception as exc:  # TensorStore raises ValueError for most failures
        raise read_error(exc, info.name) from exc
    bind(arr, policy_of(context))  # its reads (`read_slice`) keep the deadline
    return arr


class Chunks(Protocol):
    """Where a leaf reader gets stored values: ``get(keys)`` gives each key's bytes (any
    buffer), or None for a key the store does not hold."""

    async def get(self, keys: Sequence[str]) -> Sequence[Buffer | None]: ...


Buffer = bytes | np.ndarray[Any, Any]


class KvChunks:
    """Values read through TensorStore's kvstore ``kv`` (any backend), in one batch."""

    def __init__(self, kv: ts.KvStore, context: ts.Context | None = None):
        self.kv = kv
        #: A batch may take the deadline of ``context``'s policy plus its time for 1 MiB
        #: a key (a chunk's size is not known before it is read).
        self.policy = policy_of(context)

    async def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        batch = ts.Batch()  # lets OCDBT share B-tree node reads between the lookups
        reads = [self.kv.read(key, batch=batch) for key in keys]
        batch.submit()
        limit = None if self.policy is None else self.policy.limit(len(keys) << 20)
        found = await wait_all(reads, limit)
        # Each value is a copy of up to a chunk (64 MiB): made off the loop, on the CPU pool.
        return await off_loop(lambda: [_value(got) for got in found], THREAD_BYTES)


def _value(got: ts.KvStore.ReadResult) -> bytes | None:
    return got.value if got.state == "value" else None


async def read_small_leaves(
    source: Chunks, store: dict[str, Any], context: ts.Context, infos: Sequence[LeafInfo]
) -> list[np.ndarray[Any, Any]]:
    """Small single-chunk leaves (`chunks.small`) read whole, in one batch.

    A leaf whose ``zarr.json`` is exactly what a save writes and whose chunk is
    present is decoded here (its checksum checked); any other goes through
    TensorStore's reader (`open_leaf` on ``store``), which decides what is wrong with it.
    """
    keys = [key for info in infos for key in (chunks.metadata_key(info), chunks.chunk_key(info))]
    found = await get_values(source, keys, infos[0].name if len(infos) == 1 else "(a batch)")
    triples = list(zip(infos, found[::2], found[1::2], strict=True))

    def decode() -> list[np.ndarray[Any, Any] | None]:  # checksums and copies: off the loop
        out: list[np.ndarray[Any, Any] | None] = []
        for info, meta, chunk in triples:
            if meta is not None and chunk is not None and chunks.as_written(info, meta):
                # A buffer of its own (`ocdbt_index.DirectChunks`) is used as it is.
                mine = isinstance(chunk, np.ndarray) and chunk.flags.writeable
                key = chunks.chunk_key(info)
                out.append(chunks.decode_chunk(info, chunk, copy=not mine, key=key))
            else:
                out.append(None)  # TensorStore's reader decides
        return out

    decoded = await off_loop(decode, sum(info.nbytes for info in infos))
    return [
        value
        if value is not None
        else await read_slice(await open_leaf(store, context, info), (), info.name)
        for info, value in zip(infos, decoded, strict=True)
    ]


async def get_values(source: Chunks, keys: Sequence[str], leaf: str) -> Sequence[Buffer | None]:
    """``source.get(keys)``, its errors naming ``leaf``."""
    try:
        return await source.get(keys)
    except CorruptCheckpointError as exc:
        if exc.leaf is None:
            raise CorruptCheckpointError(str(exc), leaf=leaf) from exc
        raise
    except CkptStoreError:
        raise
    except Exception as exc:
        raise read_error(exc, leaf) from exc


async def read_slice(arr: ts.TensorStore, index: Index, name: str) -> np.ndarray[Any, Any]:
    part = arr[index]
    nbytes = part.size * part.dtype.numpy_dtype.itemsize
    try:
        return np.asarray(await within(part.read(), arr, nbytes, f"reading leaf {name!r}"))
    except Exception as exc:
        raise read_error(exc, name) from exc


def read_error(exc: BaseException, leaf: str) -> CkptStoreError:
    """A failed read of committed data: a typed storage error, else the data is corrupt."""
    if isinstance(exc, CkptStoreError):
        return exc
    typed = storage_error(exc, op=f"reading leaf {leaf!r}")
    if typed is not None:
        return typed
    return CorruptCheckpointError(f"cannot read stored data: {message(exc)}", leaf=leaf)
