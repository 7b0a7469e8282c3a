"""``import-orbax``: an Orbax 0.12 checkpoint converted into a committed ckptstore step.

Every item of the Orbax step is imported into one step, committed once: tree items
(``StandardSave``) as array items, JSON items (``JsonSave``) as ckptstore JSON items.
Items keep Orbax's names, except Orbax's own name for a lone tree, ``default`` (and the
one tree of a `StandardCheckpointer` directory), which becomes ``as_item`` (``state``,
the item a `CheckpointManager` saves and restores by default). ``item`` narrows the
import to one item, named the same way. An item the step's ``_CHECKPOINT_METADATA`` lists
but that is missing or torn is `CorruptCheckpointError` naming it, unless ``item`` leaves
it out (`ckptstore.orbax.items.step_items`). The step's Orbax metrics (the reserved item
``metrics``) become the step's metrics, as ``save(metrics=...)`` records them, not an item.
`import_orbax_steps` imports every step of a root (or a range) this way, checking them all
before it writes any, so a run's best-step history comes along.

The Orbax checkpoint is read by the in-place reader (`ckptstore.orbax.read`, strict
``_METADATA`` parsing, every chunk required) and written through one partial-save
session: leaves are read a bounded batch at a time, each batch becomes one part of its
item, and the part is freed before the next batch is read, so peak memory is about the
batch size (or the largest leaf). The parts are merged by reference and committed once,
with each Orbax tree's own structure (lists stay lists), so the step holds every item or
nothing. An interrupted import resumes: leaves a recorded part already holds are not read
again. The step is refused (`AlreadyExistsError`) if it is already committed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import jax
import jax.numpy as jnp

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.partial import PartialSave
from ckptstore.checkpoint.save import SaveResult
from ckptstore.checkpoint.storeditem import StoredItem, settle
from ckptstore.checkpoint.target import Target, opened
from ckptstore.datapath.reads import read_slice
from ckptstore.errors import AlreadyExistsError, CheckpointNotFoundError
from ckptstore.format import layout
from ckptstore.format.casts import CastPolicy
from ckptstore.format.codecs import CodecPolicy
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.layout import ORBAX_TREE_METADATA
from ckptstore.format.leaves import LeafInfo
from ckptstore.orbax import read as orbax
from ckptstore.orbax import steps as orbax_steps
from ckptstore.orbax.items import METRICS, TREE, read_metrics, step_items
from ckptstore.runtime.progress import Progress

DEFAULT_BATCH_BYTES = 256 << 20
_PYTHON = {"int": int, "float": float, "bool": bool, "complex": complex}


@dataclass(frozen=True)
class OrbaxImportResult:
    source: str  # the Orbax directory read
    leaves: int  # imported in this run
    skipped: int  # already held by a part of an interrupted run
    bytes: int
    parts: int
    save: SaveResult
    #: The step's items, by ckptstore name: the Orbax item each was read from.
    items: dict[str, str] = field(default_factory=dict)


#: Orbax's name for the one tree of a single-item `CheckpointManager` step.
ORBAX_DEFAULT_ITEM = "default"


async def open_orbax(
    backend: Backend, step: int | None, item: str | None, as_item: str = layout.DEFAULT_ITEM
) -> tuple[str, dict[str, tuple[str, StoredItem | JsonItem]]]:
    """(the Orbax directory, its items to import: ckptstore name -> (Orbax name, item)) at
    ``backend``: a `StandardCheckpointer` directory, or a `CheckpointManager` root's
    ``step`` (the latest finalized one by default); every item, or only ``item``."""
    where = await orbax_steps.locate(backend, step)
    if where is None:
        what = "a finalized Orbax step {step}" if step is not None else "an Orbax checkpoint"
        raise CheckpointNotFoundError(
            f"{backend.url} holds no {what.format(step=step)}", backend=backend.url
        )
    if await backend.exists(f"{where}/{ORBAX_TREE_METADATA}" if where else ORBAX_TREE_METADATA):
        chosen = item if item is not None else layout.DEFAULT_ITEM  # one tree, no names
        tree = await orbax.open_item(backend, where, chosen, default_item=layout.DEFAULT_ITEM)
        return where, {as_item: ("", tree)}
    kinds = await step_items(backend, where, only=item)  # a torn item: named, raised
    names = list(kinds) if item is None else [_orbax_name(item, kinds, f"{backend.url}/{where}")]
    if not names:
        raise CheckpointNotFoundError(
            f"Orbax step {backend.url}/{where} holds no item ckptstore reads (tree or JSON)",
            backend=backend.url,
        )
    renamed = as_item not in kinds  # Orbax's "default" becomes as_item unless that is taken
    out = {}
    for name in names:
        opened = await orbax.open_item(backend, where, name, default_item=layout.DEFAULT_ITEM)
        out[as_item if name == ORBAX_DEFAULT_ITEM and renamed else name] = (name, opened)
    return where, out


def _orbax_name(item: str, kinds: dict[str, str], place: str) -> str:
    """The Orbax item ``--item`` names: itself, or (the default item name, as `restore`
    reads it) a step's lone tree item."""
    if item in kinds:
        return item
    trees = [n for n, kind in kinds.items() if kind == TREE]
    if item == layout.DEFAULT_ITEM and len(trees) == 1:
        return trees[0]
    metrics = " (Orbax's metrics item is the step's metrics, imported with any item)"
    raise CheckpointNotFoundError(
        f"Orbax step {place} has no item {item!r} (it has {list(kinds)}); without --item "
        f"(item=None) every item is imported{metrics if item == METRICS else ''}",
        backend=place,
    )


def _batches(infos: list[LeafInfo], limit: int) -> Iterator[list[LeafInfo]]:
    batch: list[LeafInfo] = []
    size = 0
    for info in infos:
        if batch and size + info.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(info)
        size += info.nbytes
    if batch:
        yield batch


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts whose flattened leaf names are exactly the keys of ``values``."""
    tree: dict[str, Any] = {}
    for name, value in values.items():
        *heads, last = [unquote(s) for s in name.split("/")]
        node = tree
        for key in heads:
            node = node.setdefault(key, {})
        node[last] = value
    return tree


async def _load(stored: StoredItem, info: LeafInfo) -> Any:
    data = await read_slice(await stored.open(info), (), info.name)
    if info.prng_impl is not None:  # Orbax recorded typed keys: saved as such, bit-exact
        return jax.random.wrap_key_data(jnp.asarray(data), impl=info.prng_impl)
    if info.kind != "scalar":
        return data
    return _PYTHON[info.python_type](data[()]) if info.python_type else data[()]


@dataclass(frozen=True)
class OrbaxStepsImportResult:
    """What `import_orbax_steps` did: the steps it imported, and those an earlier import of
    the same Orbax steps had committed already (left as they are: a rerun resumes)."""

    source: str  # the Orbax CheckpointManager root read
    steps: dict[int, OrbaxImportResult]  # each step imported now, ascending
    already: list[int]


@dataclass(frozen=True)
class _Source:
    """One Orbax checkpoint to import, opened and checked: its items and step metrics."""

    place: str  # the Orbax directory, for messages and the manifest's ``imported_from``
    step: int  # the Orbax step (0 for a StandardCheckpointer directory)
    found: dict[str, tuple[str, StoredItem | JsonItem]]
    metrics: dict[str, Any] | None

    @property
    def items(self) -> dict[str, str]:
        """Each ckptstore item: the Orbax item it is read from."""
        return {n: orbax_name for n, (orbax_name, _) in sorted(self.found.items())}

    def metadata(self) -> dict[str, Any]:
        """The manifest's metadata: where the step came from, and (as a ckptstore save
        records ``metrics=``) the step's metrics."""
        meta = {"imported_from": self.place, "format": "orbax", "orbax_items": self.items}
        return {**meta, "metrics": self.metrics} if self.metrics else meta


@dataclass(frozen=True)
class _How:
    """How the leaves are read and stored: batch size, progress, codecs and casts."""

    batch_bytes: int
    progress: bool | Progress
    stored_as: dict[str, Any]

    @classmethod
    def of(cls, batch_bytes: int, progress: bool | Progress, codecs: Any, casts: Any) -> _How:
        """``codecs`` and ``casts`` checked (`CodecPolicy.of`, `CastPolicy.of`) before
        anything is read."""
        stored_as = {"codecs": CodecPolicy.of(codecs), "casts": CastPolicy.of(casts)}
        return cls(batch_bytes, progress, stored_as)


async def _open_source(src: Backend, step: int | None, item: str | None, as_item: str) -> _Source:
    where, found = await open_orbax(src, step, item, as_item)
    metrics = await read_metrics(src, where) if where else None
    place = f"{src.url}/{where}" if where else src.url
    return _Source(place, orbax_steps.orbax_step(where) or 0, found, metrics)


async def import_orbax(
    source: Target,
    open_session: Callable[[int, str], Awaitable[PartialSave]],
    *,
    step: int | None = None,
    item: str | None = None,
    as_step: int | None = None,
    as_item: str = layout.DEFAULT_ITEM,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool | Progress = False,
    codecs: Any = None,
    casts: Any = None,
) -> OrbaxImportResult:
    """`ckptstore.import_orbax` (`ckptstore.api`): the import is one partial-save session,
    which ``open_session(as_step, item)`` opens for the first array item (a killed import
    resumes it); every item's parts and the JSON items commit with its `finalize`, the
    step's Orbax metrics as its metrics. ``codecs``, ``casts``: how the leaves are stored
    (checked before anything is read)."""
    how = _How.of(batch_bytes, progress, codecs, casts)
    async with opened(source) as src:
        found = await _open_source(src, step, item, as_item)
        written = as_step if as_step is not None else found.step
        return await _import(found, written, open_session, how, None)


async def import_orbax_steps(
    source: Target,
    open_session: Callable[[int, str], Awaitable[PartialSave]],
    committed: Callable[[int], Awaitable[dict[str, Any] | None]],
    *,
    first: int | None = None,
    last: int | None = None,
    item: str | None = None,
    as_item: str = layout.DEFAULT_ITEM,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool | Progress = False,
    codecs: Any = None,
    casts: Any = None,
) -> OrbaxStepsImportResult:
    """`ckptstore.import_orbax_steps`: every finalized step of an Orbax `CheckpointManager`
    root from ``first`` to ``last`` (both included; None: unbounded), each as
    `import_orbax` imports one, under its own step number. Every step is opened and
    checked before any is written, so a torn one commits nothing (all are held open until
    the end: their ``_METADATA`` trees and array handles). ``committed(step)``: the
    destination's metadata of ``step`` (None where it is not committed); a step committed
    by an import of the same Orbax step and items is left as it is (a rerun resumes), any
    other is `AlreadyExistsError`, before anything is written."""
    how = _How.of(batch_bytes, progress, codecs, casts)
    async with opened(source) as src:
        there = list(await orbax_steps.finalized_dirs(src))
        low = 0 if first is None else layout.check_step(first)
        chosen = [s for s in there if low <= s and (last is None or s <= layout.check_step(last))]
        if not chosen:
            span = f"from {low} to {'the last' if last is None else last}"
            one = "" if there else " (a StandardCheckpointer directory is imported without one)"
            raise CheckpointNotFoundError(
                f"{src.url} holds no finalized Orbax step {span} (it has {there}){one}",
                backend=src.url,
            )
        sources = [await _open_source(src, s, item, as_item) for s in chosen]
        already = [s.step for s in sources if _imported(s, await committed(s.step))]
        todo = [s for s in sources if s.step not in already]
        leaves = [
            i
            for s in todo
            for _, t in s.found.values()
            if isinstance(t, StoredItem)
            for i in t.leaves.values()
        ]
        bar = Progress.make(progress, len(leaves), sum(i.nbytes for i in leaves), "leaves")
        done = {s.step: await _import(s, s.step, open_session, how, bar) for s in todo}
        bar.close()
    return OrbaxStepsImportResult(src.url, done, already)


def _imported(found: _Source, metadata: dict[str, Any] | None) -> bool:
    """Whether the destination's step ``found.step`` (``metadata``: its manifest's, None
    where it is not committed) is this Orbax step imported already, with these items;
    `AlreadyExistsError` where it is another step."""
    if metadata is None:
        return False
    if metadata.get("imported_from") == found.place and metadata.get("orbax_items") == found.items:
        return True
    raise AlreadyExistsError(
        f"step {found.step} is already committed at the destination, and not as an import "
        f"of {found.place} (items {list(found.items)}): nothing was imported. Import into "
        "another root, or leave that step out (--steps FIRST:LAST)"
    )


async def _import(
    found: _Source,
    written: int,
    open_session: Callable[[int, str], Awaitable[PartialSave]],
    how: _How,
    bar: Progress | None,
) -> OrbaxImportResult:
    """Import ``found`` as step ``written``: one partial-save session, committed once;
    ``bar`` the progress of a larger import (None: one of its own, closed at the end)."""
    trees = {n: s for n, (_, s) in sorted(found.found.items()) if isinstance(s, StoredItem)}
    configs = {n: s for n, (_, s) in found.found.items() if isinstance(s, JsonItem)}
    async with await open_session(written, min(trees or configs)) as session:
        todo = {}
        for name, tree in trees.items():
            done = session.leaves_of(name)
            todo[name] = [i for n, i in tree.leaves.items() if n not in done]
        infos = [i for leaves in todo.values() for i in leaves]
        own = bar is None
        if bar is None:
            bar = Progress.make(how.progress, len(infos), sum(i.nbytes for i in infos), "leaves")
        parts = 0
        for name, tree in trees.items():
            parts += await _add_leaves(session, name, tree, todo[name], how, bar)
        result = await session.finalize(
            metadata=found.metadata(),
            structures={name: tree.structure for name, tree in trees.items()},
            json_items=configs,
        )
        if own:
            bar.close()
    return OrbaxImportResult(
        source=found.place,
        leaves=len(infos),
        skipped=sum(len(t.leaves) for t in trees.values()) - len(infos),
        bytes=sum(i.nbytes for i in infos),
        parts=parts,
        save=result,
        items=found.items,
    )


async def _add_leaves(
    session: PartialSave,
    item: str,
    stored: StoredItem,
    todo: list[LeafInfo],
    how: _How,
    bar: Progress,
) -> int:
    """Read ``todo`` (leaves of the Orbax tree ``stored``) a batch at a time and add each
    batch as a part of ``item``, stored as ``how`` says (codecs, casts); returns how many
    parts were added."""
    parts = 0
    for batch in _batches(todo, how.batch_bytes):
        values = await settle(_load(stored, info) for info in batch)
        subtree = _nest({i.name: v for i, v in zip(batch, values, strict=True)})
        del values
        await session.add(subtree, item=item, **how.stored_as)
        del subtree
        parts += 1
        bar.advance(len(batch), sum(i.nbytes for i in batch))
    return parts
