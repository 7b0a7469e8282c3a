"""Incremental saves: which leaves a save need not write because its base step holds them.

``save(target, tree, step=, base=B)``: a leaf whose stored form (shape, dtype, chunk
shape, codec) and piece digests (`ckptstore.format.digests`) equal what committed step ``B``
recorded is not written; the new manifest records it as held by the attempt that holds
its bytes (B's own, or the one B itself referenced for it: always the original holder,
never a chain). Reads go there (`ckptstore.checkpoint.restore`, `verify`); `delete_step`
and `gc` keep every referenced attempt (`ckptstore.checkpoint.cleanup`); the commit
re-checks that B is still committed (`ckptstore.protocol.check_base`). The
model and its safety argument: docs/incremental.md.

Every process digests its own pieces of each candidate leaf; a leaf is referenced only if
every process found all its pieces unchanged (one round through the coordination
service), since a leaf is either written whole or referenced whole. Of a leaf that
changed, each process leaves out the chunks it owns that are unchanged, where the base
recorded chunk digests (`ckptstore.checkpoint.chunklevel`): a decision of its own.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.chunklevel import base_chunk_digests, plan_chunks
from ckptstore.checkpoint.declared import Declared
from ckptstore.datapath.arrays import owned_slices
from ckptstore.datapath.chunkwrites import ChunkPlan
from ckptstore.datapath.declaredwrites import DeclaredLeaf, folded
from ckptstore.errors import BaseStepGoneError, CheckpointNotFoundError, CkptStoreError
from ckptstore.format import layout
from ckptstore.format.digests import (
    ALGORITHM,
    ChunkTable,
    PieceTable,
    check_table,
    matches,
    piece_table,
)
from ckptstore.format.leaves import LeafInfo, dtype_of
from ckptstore.format.manifest import Manifest, Reference
from ckptstore.format.packs import PackRef
from ckptstore.protocol import load_committed
from ckptstore.runtime.gcpause import gc_paused
from ckptstore.runtime.handoff import Handoff

#: A writer's digests of its pieces, beside its store: ``{leaf: {bounds: digest}}``.
DIGESTS = "digests.json"


@dataclass(frozen=True)
class Base:
    """The committed step an incremental save names, as its verified manifest."""

    manifest: Manifest

    @property
    def ref(self) -> Reference:
        """The base as a manifest's ``base`` field names it."""
        if self.manifest.attempt is None:  # `table` refuses it: `save` references nothing
            raise BaseStepGoneError(
                f"base step {self.manifest.step} is a format-version-1 checkpoint (no "
                "attempt to reference); nothing was written"
            )
        return Reference(self.manifest.step, self.manifest.attempt)

    def table(self, item: str, info: LeafInfo) -> PieceTable | None:
        """The base's piece digests of ``info``'s leaf, if it stored that leaf in the same
        form (else None: the leaf is written)."""
        saved = self.manifest.items.get(item)
        if saved is None or self.manifest.attempt is None or saved.digest_algorithm != ALGORITHM:
            return None
        old = saved.leaves.get(info.name)
        if old is None or (old.shape, old.dtype, old.chunk_shape, old.codec) != (
            info.shape,
            info.dtype,
            info.chunk_shape,
            info.codec,  # another codec: other bytes, written again
        ):
            return None
        return saved.digests.get(info.name)

    def holder(self, item: str, leaf: str) -> Reference:
        """The attempt holding the bytes of ``leaf`` as the base stored it."""
        return self.manifest.holder(item, leaf) or self.ref

    def chunk_holders(
        self, item: str, leaf: str, linears: np.ndarray[Any, np.dtype[np.int64]]
    ) -> list[tuple[Reference, np.ndarray[Any, np.dtype[np.bool_]]]]:
        """The attempts holding the chunks ``linears`` of ``leaf`` as the base stored them,
        each with a mask of its chunks: the base's own, or the one the base referenced for
        the leaf or for a chunk (`Manifest.chunk_holders`)."""
        found = self.manifest.chunk_holders(item, leaf, linears)
        return [(ref or self.ref, mask) for ref, mask in found]

    def packed(self, item: str, leaf: str) -> PackRef | None:
        """Where in its holder's item the leaf is packed, if it is."""
        return self.manifest.items[item].packed.get(leaf)

    def in_part(self, item: str) -> Collection[str]:
        """The leaves of ``item`` the base holds in part (`ItemManifest.chunk_refs`)."""
        return self.manifest.items[item].chunk_refs.keys()

    def digests(self, item: str, leaf: str) -> PieceTable:
        """The piece digests the base recorded for ``leaf`` (a referenced leaf's own)."""
        return dict(self.manifest.items[item].digests[leaf])


async def open_base(backend: Backend, step: int, attempt: str | None = None) -> Base:
    """The base step ``step``: `BaseStepGoneError` unless it is committed (and, given
    ``attempt``, still committed as that attempt: a partial save's session names its base
    once, and every part must reference what that base holds)."""
    try:
        base = Base(await load_committed(backend, layout.check_step(step), recent=True))
    except BaseStepGoneError:
        raise
    except CheckpointNotFoundError as exc:
        raise BaseStepGoneError(
            f"base step {step} is not committed: {exc.message}; nothing was written",
            backend=backend.url,
        ) from exc
    if attempt is not None and base.manifest.attempt != attempt:
        raise BaseStepGoneError(
            f"base step {step} is no longer committed as attempt {attempt} (now "
            f"{base.manifest.attempt}); nothing was written",
            backend=backend.url,
            key=layout.commit_key(step),
        )
    return base


@dataclass(frozen=True)
class SameObjects:
    """Leaves (per item) a caller vouches are the very `jax.Array` objects it saved as
    ``attempt`` (the manager's previous save): the base's digests hold for them only while
    the base step is still committed as that attempt, so a base step another writer
    saved again is `BaseStepGoneError`, never a reference to its values."""

    attempt: str
    leaves: Mapping[str, Collection[str]]


@dataclass
class Unchanged:
    """What `unchanged` found: per item, the leaves every process found unchanged (not
    written), this process's digests of the other candidates (not digested again while
    they are written), and the base read (None: a full save)."""

    leaves: dict[str, set[str]]
    digested: dict[str, dict[str, PieceTable]]
    base: Base | None = None
    #: Per item, this process's chunk-level plan: the chunks of changed leaves it leaves
    #: out (the base's holders have them), and the chunk digests it made of its pieces.
    chunks: dict[str, ChunkPlan] = field(default_factory=dict)


async def unchanged(
    backend: Backend,
    step: int,
    items: Mapping[str, tuple[Sequence[LeafInfo], Sequence[Any]]],
    handoff: Handoff,
    same_objects: SameObjects | None = None,
    attempt: str | None = None,
    whole_only: bool = False,
    declared: Declared | None = None,
) -> Unchanged:
    """Every process: read base ``step``, digest its pieces of each leaf the base stored
    in the same form, compare with the base's digests, and agree with the others on the
    leaves unchanged everywhere. ``items``: per item, its leaves and their values.

    The base is read inside the processes' report round, so a base that one process
    finds gone (`BaseStepGoneError`) fails the save with that type on every process,
    rather than leaving the others waiting for it.

    ``same_objects``: leaves the caller vouches are the very objects the base attempt
    was saved from (a `jax.Array` never changes): compared by form, not digested again;
    the base must then still be that attempt. ``attempt``: the base must still be that
    attempt (`open_base`). ``whole_only`` (a partial save's part, which references leaves
    whole): a leaf the base holds in part (chunk references) is never unchanged.
    ``declared``: per item, the rows of leaves that may differ from the base, all others
    equal (`ckptstore.checkpoint.declared`). Where this process owns a chunk holding a
    declared row, the leaf is not unchanged here: the write hashes those chunks and
    writes the changed ones (`ChunkPlan.declared`); where it owns none, its pieces take
    the base's digests, unread."""
    digested: dict[str, dict[str, PieceTable]] = {}
    plans = {name: ChunkPlan({}, {}) for name in items}
    opened: list[Base] = []
    vouched = same_objects.leaves if same_objects is not None else {}
    if same_objects is not None:
        if attempt is not None and attempt != same_objects.attempt:
            raise ValueError("same_objects names another base attempt than attempt=")
        attempt = same_objects.attempt

    async def mine() -> dict[str, Any]:
        base = await open_base(backend, step, attempt)
        opened.append(base)
        same: dict[str, list[int]] = {}
        for name, (infos, values) in items.items():
            tables = digested.setdefault(name, {})
            for k, (info, value) in enumerate(zip(infos, values, strict=True)):
                recorded = base.table(name, info)
                if recorded is None or (whole_only and info.name in base.in_part(name)):
                    continue
                if info.name in vouched.get(name, ()):
                    same.setdefault(name, []).append(k)
                    continue
                pieces = owned_slices(value, handoff.me)
                chunk_table: ChunkTable = {}
                rows = (declared or {}).get(name, {}).get(info.name)
                plan = None
                if rows is not None:
                    recorded_chunks = base_chunk_digests(base, name, info)
                    plan = DeclaredLeaf.of(pieces, info, recorded_chunks, rows)
                table = None
                if plan is not None:
                    if any(plan.candidates(index, info).size for index, _, _ in pieces):
                        # Written in part, its changed chunks found as it is written.
                        plans[name].declared[info.name] = plan
                        continue
                    table = folded(pieces, info, plan.recorded, {}, chunk_table)
                if table is None:
                    itemsize = dtype_of(info.dtype).itemsize
                    table = await piece_table(
                        pieces, info.shape, info.chunk_shape, itemsize, chunk_table
                    )
                if table:  # none where this process owns no piece (a replica elsewhere)
                    tables[info.name] = table
                if matches(table, recorded):
                    same.setdefault(name, []).append(k)
                plan_chunks(plans[name], base, name, info, chunk_table)
        return {"same": same, "base": base.manifest.attempt}

    await handoff.everyone(mine)

    async def decide() -> str:
        return json.dumps(_agreed(step, list(items), await handoff.reports()))

    agreed = json.loads(await handoff.agree(decide))
    leaves = {name: {items[name][0][k].name for k in agreed.get(name, [])} for name in items}
    for name, same in leaves.items():  # their digests are the base's: not kept twice
        for leaf in same:
            digested.get(name, {}).pop(leaf, None)
            plans[name].digests.pop(leaf, None)
            plans[name].held.pop(leaf, None)
    return Unchanged(leaves, digested, opened[0], plans)


def _agreed(step: int, items: Sequence[str], reports: Sequence[dict[str, Any]]) -> Any:
    """Process 0: per item, the indices of the leaves every process found unchanged. Every
    process must have read the same attempt of the base: chunk holders come from the base
    each read (`BaseStepGoneError` if it was committed again between their reads)."""
    read = {report.get("base") for report in reports}
    if len(read) > 1:
        raise BaseStepGoneError(
            f"base step {step} was committed again while the processes read it "
            f"(attempts {sorted(map(str, read))}); nothing was written"
        )
    agreed: dict[str, list[int]] = {}
    for name in items:
        found = [set(report["same"].get(name, [])) for report in reports]
        agreed[name] = sorted(set.intersection(*found)) if found else []
    return agreed


@dataclass
class References:
    """The attempts a new manifest references, in order (`Manifest.references`)."""

    holders: list[Reference]
    #: Each holder's place in ``holders`` (asked once per chunk: thousands per leaf).
    _places: dict[Reference, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._places = {ref: k for k, ref in enumerate(self.holders)}

    def index(self, holder: Reference) -> int:
        """``holder``'s place in ``holders``, appended if it is not there yet."""
        place = self._places.get(holder)
        if place is None:
            place = self._places[holder] = len(self.holders)
            self.holders.append(holder)
        return place


async def write_digests(backend: Backend, store: str, digests: dict[str, PieceTable]) -> int:
    """Write one writer's piece digests beside its store (`DIGESTS`); how many leaves it
    wrote them for. A leaf of which this process wrote no piece may have an empty table
    (it is left out), and with no table left nothing is written (a process that wrote
    nothing of a part creates nothing below it)."""
    with gc_paused():  # an object per leaf: see `ckptstore.runtime.gcpause`
        tables = {leaf: table for leaf, table in digests.items() if table}
        if not tables:
            return 0
        data = json.dumps(tables, separators=(",", ":")).encode()
    await backend.write(f"{store}/{DIGESTS}", data)
    return len(tables)


async def read_digests(backend: Backend, stores: Sequence[str]) -> dict[str, PieceTable]:
    """The piece digests written beside each of ``stores`` (`write_digests`), joined per
    leaf; `CkptStoreError` if one is unreadable."""
    out: dict[str, PieceTable] = {}
    for store in stores:
        key = f"{store}/{DIGESTS}"
        try:
            with gc_paused():
                doc = json.loads(await backend.read(key))
                if not isinstance(doc, dict):
                    raise ValueError("not a JSON object")
                for leaf, table in doc.items():
                    out.setdefault(leaf, {}).update(check_table(leaf, table))
        except ValueError as exc:
            raise CkptStoreError(f"unreadable digests {key}: {exc}") from exc
    return out
