"""Partial saves: build one checkpoint step from many parts, in O(total bytes).

Each `PartialSave.add` writes a *new* directory ``<step>/<item>/pending_<k>/``
holding per-process OCDBT stores, then records the part with a small
``PART.json`` created last (so a part is complete exactly when its record
exists). Nothing already written is copied or renamed, on any backend.
`PartialSave.finalize` merges every part by reference in one atomic
transaction, validates, and commits the step as a normal save does.

Reopening a session for the same step (after a crash) keeps the parts that
completed, discards any that did not, and continues.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ckptstore import distributed
from ckptstore.arrays import LeafInfo, describe_leaf, ocdbt_spec, write_leaves
from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.handoff import Handoff
from ckptstore.checkpoint.manifest import ItemManifest, Manifest
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.save import SaveResult, commit, ensure_uncommitted
from ckptstore.checkpoint.target import Target, opened
from ckptstore.checkpoint.tree import describe, flatten
from ckptstore.errors import CkptStoreError, CorruptCheckpointError

PART_RECORD = "PART.json"


class DuplicateLeafError(CkptStoreError, ValueError):
    """A part adds leaves an earlier part already holds, without ``replace=True``."""

    def __init__(self, names: list[str]):
        self.names = names
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        super().__init__(f"leaves already saved by an earlier part: {shown} (pass replace=True)")


@dataclass(frozen=True)
class Part:
    """One completed part of a partial save."""

    index: int
    leaves: dict[str, LeafInfo]
    structure: dict[str, Any]
    replace: bool
    processes: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.leaves.values())

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "index": self.index,
                "replace": self.replace,
                "structure": self.structure,
                "processes": self.processes,
                "leaves": {n: info.to_json() for n, info in self.leaves.items()},
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Part:
        try:
            doc = json.loads(data)
            return cls(
                index=int(doc["index"]),
                leaves={n: LeafInfo.from_json(n, d) for n, d in doc["leaves"].items()},
                structure=doc["structure"],
                replace=bool(doc["replace"]),
                processes=list(doc["processes"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"unreadable part record {where}: {exc}") from exc


def merge_structures(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Overlay one tree description on another: dicts merge key by key, else ``extra`` wins."""
    if base.get("t") != "dict" or extra.get("t") != "dict":
        return extra
    keys = [tuple(k) for k in base["keys"]]
    items = list(base["items"])
    for key, item in zip(extra["keys"], extra["items"], strict=True):
        key = tuple(key)
        if key in keys:
            i = keys.index(key)
            items[i] = merge_structures(items[i], item)
        else:
            keys.append(key)
            items.append(item)
    return {"t": "dict", "keys": [list(k) for k in keys], "items": items}


class PartialSave:
    """A partial-save session for one step; open it with `PartialSave.open`."""

    def __init__(
        self, backend: Backend, step: int, item: str, timeout: float, owned: Any = None
    ) -> None:
        self.backend = backend
        self.step = step
        self.item = item
        self.timeout = timeout
        self.parts: list[Part] = []
        self.discarded: list[int] = []  # incomplete parts removed on open (process 0)
        self._owned = owned  # the context manager that opened the backend, if we did
        self._finalized = False

    # ---- life cycle ----

    @classmethod
    async def open(
        cls,
        target: Target,
        step: int,
        *,
        item: str = layout.DEFAULT_ITEM,
        timeout: float = distributed.DEFAULT_TIMEOUT,
    ) -> PartialSave:
        """Open (or resume) the partial save of ``step``."""
        layout.check_step(step)
        if isinstance(target, Backend):
            session = cls(target, step, item, timeout)
        else:
            owned = opened(target)
            session = cls(await owned.__aenter__(), step, item, timeout, owned)
        try:
            await session._resume()
        except BaseException:
            await session.close()
            raise
        return session

    async def close(self) -> None:
        """Release the backend if the session opened it. Parts stay for a later resume."""
        if self._owned is not None:
            owned, self._owned = self._owned, None
            await owned.__aexit__(None, None, None)

    async def __aenter__(self) -> PartialSave:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _resume(self) -> None:
        await ensure_uncommitted(self.backend, self.step)
        handoff = Handoff(f"partial/{self.step}/open", self.timeout)
        await handoff.primary(self._clean)
        self.parts = await self._load_parts()

    async def _clean(self) -> None:
        """Remove incomplete parts and anything a crashed finalize left outside the parts."""
        item_dir = layout.item_dir(self.step, self.item)
        for name in await self.backend.list_dir(item_dir):
            path = f"{item_dir}/{name}"
            if name.startswith("pending_"):
                if not await self.backend.exists(f"{path}/{PART_RECORD}"):
                    self.discarded.append(int(name.removeprefix("pending_")))
                    await self.backend.delete_prefix(path)
            elif name == "manifest.ocdbt":
                await self.backend.delete(path)
            else:
                await self.backend.delete_prefix(path)
        await self.backend.delete(layout.manifest_key(self.step))

    async def _load_parts(self) -> list[Part]:
        item_dir = layout.item_dir(self.step, self.item)
        parts = []
        for name in await self.backend.list_dir(item_dir):
            if name.startswith("pending_"):
                key = f"{item_dir}/{name}/{PART_RECORD}"
                parts.append(Part.from_bytes(await self.backend.read(key), key))
        return sorted(parts, key=lambda p: p.index)

    # ---- parts ----

    @property
    def leaves(self) -> dict[str, LeafInfo]:
        """Every leaf saved so far (a later part's version of a replaced leaf)."""
        out: dict[str, LeafInfo] = {}
        for part in self.parts:
            out.update(part.leaves)
        return out

    async def add(self, subtree: Any, *, replace: bool = False) -> Part:
        """Write ``subtree`` as a new part; returns once the part is durable and recorded."""
        if self._finalized:
            raise CkptStoreError(f"step {self.step} is already finalized")
        named = flatten(subtree)
        infos = [describe_leaf(name, value) for name, value in named]
        if not replace:
            taken = sorted(set(self.leaves) & {info.name for info in infos})
            if taken:
                raise DuplicateLeafError(taken)
        index = self.parts[-1].index + 1 if self.parts else 0  # same on every process
        handoff = Handoff(f"partial/{self.step}/add/{index}", self.timeout)

        async def write_mine() -> dict[str, Any]:
            store = layout.pending_store(self.step, self.item, index, handoff.me)
            with self.backend.write_behind(store):
                stats = await write_leaves(
                    ocdbt_spec(self.backend.kvstore_spec(store)),
                    self.backend.ts_context,
                    list(zip(infos, (value for _, value in named), strict=True)),
                    process=handoff.me,
                    write_metadata=handoff.me == 0,
                )
            return stats.to_json()

        await handoff.everyone(write_mine)
        part = Part(
            index=index,
            leaves={info.name: info for info in infos},
            structure=describe(subtree),
            replace=replace,
            processes=[],
        )

        async def record() -> Part:
            recorded = dataclasses.replace(part, processes=await handoff.reports())
            key = f"{layout.pending_dir(self.step, self.item, index)}/{PART_RECORD}"
            await self.backend.create(key, recorded.to_bytes())
            return recorded

        part = await handoff.primary(record) or part
        self.parts.append(part)
        return part

    async def finalize(self, *, metadata: dict[str, Any] | None = None) -> SaveResult:
        """Merge every part by reference, validate, and commit the step."""
        if self._finalized:
            raise CkptStoreError(f"step {self.step} is already finalized")
        if not self.parts:
            raise CkptStoreError(f"step {self.step}: nothing to finalize (no parts were added)")
        start = time.perf_counter()
        handoff = Handoff(f"partial/{self.step}/finalize", self.timeout)
        merge_seconds = await handoff.primary(lambda: self._merge_and_commit(metadata))
        self._finalized = True
        leaves = self.leaves
        await self.close()
        return SaveResult(
            step=self.step,
            bytes=sum(info.nbytes for info in leaves.values()),
            bytes_written=sum(part.nbytes for part in self.parts),
            seconds=time.perf_counter() - start,
            merge_seconds=merge_seconds or 0.0,
        )

    async def _merge_and_commit(self, metadata: dict[str, Any] | None) -> float:
        step, item = self.step, self.item
        stores: list[str] = []
        clear: dict[str, list[str]] = {}
        seen: set[str] = set()
        structure: dict[str, Any] = {"t": "dict", "keys": [], "items": []}
        processes: list[dict[str, Any]] = []
        for part in self.parts:
            replaced = sorted(seen & set(part.leaves))
            part_stores = [
                layout.pending_store(step, item, part.index, p) for p in range(_writers(part))
            ]
            if replaced:
                clear[part_stores[0]] = replaced
            stores += part_stores
            seen |= set(part.leaves)
            structure = merge_structures(structure, part.structure)
            processes += [{"part": part.index, **p} for p in part.processes]
        leaves = self.leaves
        merged = await merge(
            self.backend, layout.item_dir(step, item), stores, list(leaves.values()), clear
        )
        manifest = Manifest(
            step=step,
            items={
                item: ItemManifest(
                    structure=structure,
                    leaves=leaves,
                    parts=[s.removeprefix(layout.item_dir(step, item) + "/") for s in stores],
                )
            },
            processes=processes,
            metadata=metadata or {},
        )
        await commit(self.backend, step, manifest)
        return merged.seconds


def _writers(part: Part) -> int:
    """How many processes wrote ``part`` (each has its own store)."""
    return max(1, len(part.processes))


async def partial_save(
    target: Target,
    step: int,
    *,
    item: str = layout.DEFAULT_ITEM,
    timeout: float = distributed.DEFAULT_TIMEOUT,
) -> PartialSave:
    """Open (or resume) a partial-save session for ``step``: see `PartialSave`."""
    return await PartialSave.open(target, step, item=item, timeout=timeout)
