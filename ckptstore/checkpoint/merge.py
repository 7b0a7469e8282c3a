"""The merge: many OCDBT stores become one, atomically, by copying references.

Every per-process (or pending) store is copied into the parent store with
``experimental_copy_range_to`` inside one atomic `tensorstore.Transaction`.
OCDBT copies B-tree references, not data, so the parent references the data
files in the child directories (which must therefore never be deleted). Before
the single commit, the uncommitted view is validated: every leaf needs its
``zarr.json`` and every chunk its shape implies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.backends.tserrors import write_error
from ckptstore.datapath.stores import ocdbt_spec
from ckptstore.errors import CkptStoreError, IncompleteCheckpointError
from ckptstore.format import chunks
from ckptstore.format.leaves import Index, LeafInfo
from ckptstore.runtime.futures import finish_first, wait_all


@dataclass(frozen=True)
class MergeStats:
    stores: int
    keys: int
    seconds: float


async def merge(
    backend: Backend,
    parent: str,
    children: Sequence[str],
    leaves: Sequence[LeafInfo],
    clear_before: Mapping[str, Sequence[str]] | None = None,
    regions: Mapping[str, Sequence[Index] | None] | None = None,
    fresh: bool = False,
) -> MergeStats:
    """Merge the OCDBT stores at ``children`` into the one at ``parent``, then validate.

    Children must lie below ``parent`` (OCDBT references their data files by
    relative path). They are copied concurrently, so their keys must not
    overlap, except that ``clear_before[child]`` names leaves whose keys are
    dropped once every earlier child is copied and before ``child`` is (a later
    part replacing a leaf, maybe with another chunk grid). Raises
    `IncompleteCheckpointError` naming every incomplete leaf; then nothing is
    committed. ``regions`` (a host-local fast tier's own copy): per leaf, the regions
    whose chunks must be there (None: all of them) instead of every chunk. ``fresh``: the
    parent is new, its configuration assumed (`ocdbt_spec`).
    """
    start = time.perf_counter()
    ctx = backend.ts_context
    parent_spec = ocdbt_spec(backend.kvstore_spec(parent), fresh=fresh)
    parent_kv = await ts.KvStore.open(parent_spec, context=ctx)
    txn = ts.Transaction(atomic=True)
    view = parent_kv.with_transaction(txn)
    try:
        # The parent ends up exactly the union of the children, even where an earlier,
        # interrupted merge (a crashed partial-save finalize) already committed into it.
        await view.delete_range(ts.KvStore.KeyRange())
        child_kvs = await asyncio.gather(  # opening reads each manifest: do it concurrently
            *(ts.KvStore.open(ocdbt_spec(backend.kvstore_spec(c)), context=ctx) for c in children)
        )
        segment: list[ts.KvStore] = []
        for child, child_kv in zip(children, child_kvs, strict=True):
            cleared = (clear_before or {}).get(child, ())
            if cleared:  # everything before this child lands first, then the leaves go
                await _copy_all(segment, view)
                segment = []
                for name in cleared:
                    await view.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0"))
            segment.append(child_kv)
        await _copy_all(segment, view)
        keys = [k.decode() for k in await view.list()]
        problems = await validate(view, keys, leaves, regions)
        if problems:
            raise IncompleteCheckpointError(
                f"merge of {len(children)} store(s) into {parent!r} is incomplete", leaves=problems
            )
        await finish_first(txn.commit_async())
    except BaseException as exc:
        if not txn.commit_started:
            txn.abort()
        if isinstance(exc, Exception) and not isinstance(exc, CkptStoreError):
            raise write_error(exc, f"the merge into {parent!r}") from exc  # TensorStore's
        raise
    return MergeStats(stores=len(children), keys=len(keys), seconds=time.perf_counter() - start)


async def _copy_all(children: Sequence[ts.KvStore], view: ts.KvStore) -> None:
    await asyncio.gather(*(child.experimental_copy_range_to(view) for child in children))


def expected_chunks(info: LeafInfo, region: Index | None = None) -> Iterable[str]:
    """Chunk keys (zarr3 default encoding) the leaf's shape and chunk shape imply; with
    ``region`` (step-1 slices), those overlapping it."""
    if not info.shape:
        yield "c"
        return
    ranges = []
    for dim, (size, chunk) in enumerate(zip(info.shape, info.chunk_shape, strict=True)):
        start, stop = region[dim].indices(size)[:2] if region is not None else (0, size)
        ranges.append(range(start // chunk, math.ceil(stop / chunk)))
    for index in itertools.product(*ranges):
        yield "c/" + "/".join(map(str, index))


def _wanted_chunks(info: LeafInfo, regions: Sequence[Index] | None) -> list[str]:
    if regions is None:
        return list(expected_chunks(info))
    return sorted({key for region in regions for key in expected_chunks(info, region)})


def owner(key: str, names: set[str]) -> tuple[str | None, str]:
    """The leaf a stored key belongs to, and the key below that leaf.

    No leaf name is a directory prefix of another (leaves have no children), so
    the shortest matching prefix is the owner.
    """
    cut = key.find("/")
    while cut != -1:
        if key[:cut] in names:
            return key[:cut], key[cut + 1 :]
        cut = key.find("/", cut + 1)
    return None, key


async def validate(
    view: ts.KvStore,
    keys: Sequence[str],
    leaves: Sequence[LeafInfo],
    regions: Mapping[str, Sequence[Index] | None] | None = None,
) -> dict[str, str]:
    """Problems per leaf name in the (uncommitted) merged view; empty when complete (with
    ``regions``: every leaf's metadata and the chunks of its listed regions are there)."""
    present: dict[str, set[str]] = defaultdict(set)
    names = {info.name for info in leaves}
    for key in keys:
        leaf, rest = owner(key, names)
        if leaf is not None:
            present[leaf].add(rest)

    problems: dict[str, str] = {}
    complete = [info for info in leaves if "zarr.json" in present.get(info.name, set())]
    for info in leaves:
        if "zarr.json" not in present.get(info.name, set()):
            problems[info.name] = "zarr.json missing"
    batch = ts.Batch()  # one batch lets OCDBT share B-tree node reads between the lookups
    reads = [view.read(f"{info.name}/zarr.json", batch=batch) for info in complete]
    batch.submit()
    metas = await wait_all(reads)
    for info, meta_read in zip(complete, metas, strict=True):
        if not chunks.as_written(info, meta_read.value):
            problem = _metadata_problem(info, meta_read.value)
            if problem:
                problems[info.name] = problem
                continue
        have = present[info.name]
        wanted = _wanted_chunks(info, (regions or {}).get(info.name))
        missing = [c for c in wanted if c not in have]
        if missing:
            total = len(wanted)
            problems[info.name] = f"{len(missing)} of {total} chunks missing (first: {missing[0]})"
    return problems


def _metadata_problem(info: LeafInfo, meta_bytes: bytes) -> str | None:
    """What is wrong with a leaf's ``zarr.json`` (another writer's, or another version's
    spelling), or None if its shape and dtype are the leaf's."""
    try:
        meta = json.loads(meta_bytes)
        stored = (tuple(meta.get("shape", ())), meta.get("data_type"))
    except (ValueError, TypeError, AttributeError):
        return "zarr.json is not a JSON object"
    if stored != (info.shape, info.dtype):
        return f"zarr.json says {stored[1]}{list(stored[0])}"
    return None
