"""``import-orbax``: an Orbax 0.12 checkpoint converted into a committed ckptstore step.

The Orbax checkpoint is read by the in-place reader (`ckptstore.orbax.read`,
strict ``_METADATA`` parsing, every chunk required) and written through a partial
save: leaves are read a bounded batch at a time, each batch becomes one part, and the
part is freed before the next batch is read, so peak memory is about the batch size
(or the largest leaf). The parts are merged by reference and committed once, with
the Orbax tree's own structure (lists stay lists). An interrupted import resumes:
leaves a recorded part already holds are not read again. The step is refused
(`AlreadyExistsError`) if it is already committed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import jax
import jax.numpy as jnp

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.partial import PartialSave
from ckptstore.checkpoint.save import SaveResult
from ckptstore.checkpoint.stored import StoredItem, settle
from ckptstore.checkpoint.target import Target, opened
from ckptstore.datapath.reads import read_slice
from ckptstore.errors import CheckpointNotFoundError, UnsupportedOperationError
from ckptstore.format import layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.leaves import LeafInfo
from ckptstore.orbax import read as orbax
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


async def open_orbax(
    backend: Backend, step: int | None, item: str | None
) -> tuple[str, StoredItem]:
    """(the Orbax directory, its item) at ``backend``: a `StandardCheckpointer` directory,
    or a `CheckpointManager` root's ``step`` (the latest finalized one by default)."""
    where = await orbax.locate(backend, step)
    if where is None:
        what = "a finalized Orbax step {step}" if step is not None else "an Orbax checkpoint"
        raise CheckpointNotFoundError(
            f"{backend.url} holds no {what.format(step=step)}", backend=backend.url
        )
    chosen = item if item is not None else layout.DEFAULT_ITEM
    stored = await orbax.open_item(backend, where, chosen, default_item=layout.DEFAULT_ITEM)
    if isinstance(stored, JsonItem):
        raise UnsupportedOperationError(
            f"item {chosen!r} of {backend.url}/{where} is a JSON item, which import-orbax "
            "does not import yet: restore it in place (restore(..., item=...))"
        )
    return where, stored


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
) -> OrbaxImportResult:
    """`ckptstore.import_orbax` (`ckptstore.api`): the import is a partial save, the
    session ``open_session(as_step, as_item)`` opens (a killed import resumes)."""
    async with opened(source) as src:
        where, stored = await open_orbax(src, step, item)
        written = as_step if as_step is not None else (layout.parse_step(where) or 0)
        place = f"{src.url}/{where}" if where else src.url
        async with await open_session(written, as_item) as session:
            done = set(session.leaves)
            todo = [info for name, info in stored.leaves.items() if name not in done]
            bar = Progress.make(progress, len(todo), sum(i.nbytes for i in todo), "leaves")
            parts = 0
            for batch in _batches(todo, batch_bytes):
                values = await settle(_load(stored, info) for info in batch)
                subtree = _nest({i.name: v for i, v in zip(batch, values, strict=True)})
                del values
                await session.add(subtree)
                del subtree
                parts += 1
                bar.advance(len(batch), sum(i.nbytes for i in batch))
            result = await session.finalize(
                metadata={"imported_from": place, "format": "orbax"},
                structure=stored.structure,
            )
            bar.close()
    return OrbaxImportResult(
        source=place,
        leaves=len(todo),
        skipped=len(stored.leaves) - len(todo),
        bytes=sum(i.nbytes for i in todo),
        parts=parts,
        save=result,
    )
