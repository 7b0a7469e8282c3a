"""Where each value of an OCDBT store lies, so chunk data can be read without TensorStore.

Reading a value through TensorStore's kvstore costs three copies of it (into
TensorStore's buffer, into a string, into Python bytes) and a page fault per fresh
page; on local disk that is several times the cost of the read itself. An OCDBT
store is a B+tree whose leaves name, for each key, a data file, an offset and a
length (or hold small values inline). TensorStore's public `tensorstore.ocdbt.dump`
returns those nodes already parsed and checked; `load` walks them once per restore,
and `DirectChunks` then reads each value straight into an aligned buffer with
`Backend.read_into` (one copy, from the operating system).

Anything this module does not expect (a node shape, a path that would leave the
store's directory, a key count that disagrees with the tree's own statistics) makes
`load` return None, and the caller reads through TensorStore as before.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.errors import CorruptCheckpointError, NotFoundError, ShortReadError
from ckptstore.runtime.hostpool import aligned_empty

#: Neighbouring values of one data file closer than this are fetched in one read.
MAX_GAP = 1 << 20
#: ... as long as that read stays under this size.
MAX_COALESCED = 32 << 20

_SAFE_PATH = re.compile(r"[A-Za-z0-9._\-/]*")


@dataclass(frozen=True)
class Location:
    """Bytes ``[offset, offset + length)`` of the data file ``path`` (relative to the store)."""

    path: str
    offset: int
    length: int


Value = Location | bytes


async def load(base: ts.KvStore) -> dict[str, Value] | None:
    """Every key of the OCDBT store on ``base`` (its latest version) and where its value
    lies; None where the store is not laid out the way this module understands."""
    try:
        manifest = await ts.ocdbt.dump(base)
        latest = manifest["versions"][-1]
        root = latest["root"]
        if "location" not in root:
            return {} if root["statistics"]["num_keys"] == 0 else None
        out: dict[str, Value] = {}
        if not await _walk(base, root["location"], b"", out):
            return None
        return out if len(out) == root["statistics"]["num_keys"] else None
    except Exception:  # anything unexpected: TensorStore's own reader takes over
        return None


async def _walk(base: ts.KvStore, location: str, prefix: bytes, out: dict[str, Value]) -> bool:
    node = await ts.ocdbt.dump(base, location)
    children = []
    for entry in node["entries"]:
        key = prefix + bytes(entry["key"])
        if "indirect_value" in entry:
            where = _parse(entry["indirect_value"])
            if where is None:
                return False
            out[key.decode()] = where
        elif "inline_value" in entry:
            out[key.decode()] = bytes(entry["inline_value"])
        elif "location" in entry:
            children.append((entry["location"], prefix + bytes(entry["subtree_common_prefix"])))
        else:
            return False
    results = await asyncio.gather(*(_walk(base, loc, pre, out) for loc, pre in children))
    return all(results)


def _parse(text: str) -> Location | None:
    """``value:<base path>:<relative path>:<offset>:<length>`` as a `Location`."""
    kind, sep, rest = text.partition(":")
    fields = rest.rsplit(":", 2)
    if kind != "value" or not sep or len(fields) != 3:
        return None
    name, offset, length = fields
    path = name.replace(":", "", 1)  # the base path and the relative path, joined
    parts = path.split("/")
    if not _SAFE_PATH.fullmatch(path) or path.startswith("/") or ".." in parts:
        return None
    if not (offset.isdigit() and length.isdigit()):
        return None
    return Location(path, int(offset), int(length))


class DirectChunks:
    """Values of the OCDBT store under key ``prefix`` read from its data files through
    ``backend``.

    ``get(keys)`` returns, per key, its bytes in a 64-byte aligned, writable uint8
    array of its own (None for a key the store does not hold): the data of a chunk can
    become a device buffer without another copy. Nearby values of one file are read
    with one vectored read, each straight into its own buffer.
    """

    def __init__(self, backend: Backend, prefix: str, index: dict[str, Value]):
        self.backend, self.prefix, self.index = backend, prefix, index
        self._sizes: dict[str, asyncio.Future[ObjectInfo]] = {}

    async def get(self, keys: Sequence[str]) -> list[np.ndarray[Any, Any] | None]:
        out: list[np.ndarray[Any, Any] | None] = [None] * len(keys)
        wanted: dict[str, list[tuple[int, Location]]] = {}
        for k, key in enumerate(keys):
            value = self.index.get(key)
            if isinstance(value, bytes):  # inline in the tree: small
                out[k] = _owned(value)
            elif value is not None:
                wanted.setdefault(value.path, []).append((k, value))
        reads = [run for locs in wanted.values() for run in _runs(locs)]
        for run, fetched in zip(reads, await asyncio.gather(*map(self._fetch, reads)), strict=True):
            for (k, _), data in zip(run, fetched, strict=True):
                out[k] = data
        return out

    async def _fetch(self, run: list[tuple[int, Location]]) -> list[np.ndarray[Any, Any]]:
        """The values of ``run`` (nearby, in offset order), read with one vectored read;
        the bytes between them land in a scratch buffer."""
        first, last = run[0][1], run[-1][1]
        key, end = f"{self.prefix}/{first.path}", last.offset + last.length
        size = await self._size(key)
        if end > size:  # checked before a buffer is sized by what the tree claims
            raise CorruptCheckpointError(f"{key}: a value ends at byte {end}, the file at {size}")
        gaps = [b.offset - (a.offset + a.length) for (_, a), (_, b) in itertools.pairwise(run)]
        scratch = memoryview(bytearray(max(gaps, default=0)))
        values = [aligned_empty((loc.length,), np.dtype(np.uint8)) for _, loc in run]
        buffers = [values[0].data]
        for gap, value in zip(gaps, values[1:], strict=True):
            buffers += [scratch[:gap], value.data] if gap else [value.data]
        try:
            await self.backend.read_into(key, first.offset, buffers)
        except ShortReadError as exc:  # shrunk since its size was checked: damage
            raise CorruptCheckpointError(str(exc)) from exc
        return values

    async def _size(self, key: str) -> int:
        if key not in self._sizes:  # one stat per data file, shared by concurrent reads
            self._sizes[key] = asyncio.ensure_future(self.backend.stat(key))
        try:
            info = await asyncio.shield(self._sizes[key])
        except NotFoundError as exc:
            raise CorruptCheckpointError(f"data file {key} is missing") from exc
        return info.size


def _runs(locs: list[tuple[int, Location]]) -> list[list[tuple[int, Location]]]:
    """Values of one file in offset order, grouped into reads of nearby values."""
    locs = sorted(locs, key=lambda kl: kl[1].offset)
    runs: list[list[tuple[int, Location]]] = []
    for k, loc in locs:
        if runs:
            start, end = runs[-1][0][1].offset, runs[-1][-1][1]
            end_byte = end.offset + end.length
            near = loc.offset - end_byte <= MAX_GAP and loc.offset >= end_byte
            if near and loc.offset + loc.length - start <= MAX_COALESCED:
                runs[-1].append((k, loc))
                continue
        runs.append([(k, loc)])
    return runs


def _owned(data: bytes) -> np.ndarray[Any, Any]:
    buf = aligned_empty((len(data),), np.dtype(np.uint8))
    buf[:] = np.frombuffer(data, np.uint8)
    return buf
