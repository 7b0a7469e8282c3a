"""What an Orbax 0.12 checkpoint holds, and whether every leaf reads: for ``ckptstore
ls``, ``info`` and ``verify`` pointed at an Orbax directory or `CheckpointManager` root.
JSON items (``ocp.args.JsonSave``) are listed beside the tree items, with their values.

Orbax's zarr v2 chunks carry no checksum, so `verify_orbax` proves that every chunk
exists and decodes (a missing chunk or data file, a truncated or undecodable chunk, a
malformed ``_METADATA``), not that the numbers are the ones written.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.storeditem import StoredItem
from ckptstore.datapath.reads import read_slice
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError
from ckptstore.format import layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.layout import ORBAX_TREE_METADATA
from ckptstore.format.leaves import LeafInfo
from ckptstore.orbax import read as orbax
from ckptstore.orbax import steps as orbax_steps
from ckptstore.orbax.items import step_items
from ckptstore.runtime.membudget import check_fits

#: How the one tree of a StandardCheckpointer directory is shown (Orbax names it not).
TREE_ITEM = "(tree)"
#: Bytes read at once when verifying a large leaf.
READ_BYTES = 64 << 20
CONCURRENCY = 8


@dataclass
class OrbaxStep:
    """One Orbax checkpoint: a `CheckpointManager` step, or a directory (``step`` None)."""

    step: int | None
    where: str  # relative to the backend root; "" for a StandardCheckpointer directory
    items: dict[str, dict[str, LeafInfo]] = field(default_factory=dict)
    #: Its JSON items (``ocp.args.JsonSave``): their values.
    json_items: dict[str, JsonItem] = field(default_factory=dict)
    error: str | None = None  # why it cannot be read

    @property
    def leaves(self) -> int:
        return sum(len(v) for v in self.items.values())

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for v in self.items.values() for i in v.values())

    @property
    def names(self) -> list[str]:
        """Every item's name, tree and JSON, sorted."""
        return sorted([*self.items, *self.json_items])


async def _items(backend: Backend, where: str) -> list[str]:
    if await backend.exists(f"{where}/{ORBAX_TREE_METADATA}" if where else ORBAX_TREE_METADATA):
        return [""]
    return list(await step_items(backend, where))  # a listed item missing: raised


async def describe_step(backend: Backend, step: int | None, where: str) -> OrbaxStep:
    """Every item's leaves; damage is recorded in ``error``, not raised."""
    out = OrbaxStep(step, where)
    try:
        for name in await _items(backend, where):
            stored = await orbax.open_item(
                backend, where, name or layout.DEFAULT_ITEM, default_item=layout.DEFAULT_ITEM
            )
            if isinstance(stored, JsonItem):
                out.json_items[name] = stored
            else:
                out.items[name or TREE_ITEM] = dict(stored.leaves)
    except CkptStoreError as exc:
        out.error = str(exc)
    return out


async def find(backend: Backend, step: int | None = None) -> list[tuple[int | None, str]]:
    """The Orbax checkpoints at ``backend``: [(None, "")] for a StandardCheckpointer
    directory, else the finalized steps of a `CheckpointManager` root (only ``step``
    when given). Empty when there is none."""
    if step is None and await backend.exists(ORBAX_TREE_METADATA):
        return [(None, "")]
    dirs = await orbax_steps.finalized_dirs(backend, step)
    return list(dirs.items())


@dataclass
class OrbaxVerifyReport:
    where: str
    step: int | None
    leaves: int = 0
    bytes: int = 0
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


async def verify_orbax(backend: Backend, step: int | None = None) -> OrbaxVerifyReport:
    """Read every leaf of every item of an Orbax checkpoint (the latest step by default)."""
    found = await find(backend, step)
    if not found:
        raise CheckpointNotFoundError(
            f"no Orbax checkpoint{'' if step is None else f' step {step}'} at {backend.url}",
            backend=backend.url,
        )
    step, where = found[-1]
    report = OrbaxVerifyReport(f"{backend.url}/{where}" if where else backend.url, step)
    try:
        names = await _items(backend, where)
    except CkptStoreError as exc:
        report.problems[where or "."] = str(exc)
        return report
    limit = asyncio.Semaphore(CONCURRENCY)
    for name in names:
        shown = name or TREE_ITEM
        try:
            stored = await orbax.open_item(
                backend, where, name or layout.DEFAULT_ITEM, default_item=layout.DEFAULT_ITEM
            )
        except CkptStoreError as exc:
            report.problems[shown] = str(exc)
            continue
        if isinstance(stored, JsonItem):  # read and parsed strictly: nothing more to check
            continue

        async def check(info: LeafInfo, stored: StoredItem = stored, shown: str = shown) -> None:
            async with limit:
                try:
                    nbytes = await read_all(await stored.open(info), info)
                    report.bytes += nbytes  # not `+= await`: that reads the total first
                except CkptStoreError as exc:
                    report.problems[f"{shown}/{info.name}"] = str(exc)

        await asyncio.gather(*(check(info) for info in stored.leaves.values()))
        report.leaves += len(stored.leaves)
    return report


async def read_all(arr: ts.TensorStore, info: LeafInfo) -> int:
    """Read every byte of one leaf, a slab of whole chunks at a time."""
    if not info.shape or info.nbytes <= READ_BYTES:
        await read_slice(arr, (), info.name)
        return info.nbytes
    rows = max(1, READ_BYTES // max(1, info.nbytes // info.shape[0]))
    rows = math.ceil(rows / info.chunk_shape[0]) * info.chunk_shape[0]
    check_fits(min(rows, info.shape[0]) * (info.nbytes // info.shape[0]), "a slab", leaf=info.name)
    for start in range(0, info.shape[0], rows):
        await read_slice(arr, (slice(start, start + rows),), info.name)
    return info.nbytes
