"""The items of an Orbax 0.12 step, and reading its JSON items.

An Orbax `CheckpointManager` step holds one directory per item. Two kinds are read:

- tree items (``ocp.args.StandardSave``, ``PyTreeSave``): a directory with ``_METADATA``
  (the tree) and the arrays, read by `ckptstore.orbax.read.open_item`;
- JSON items (``ocp.args.JsonSave``): a directory with one file, ``metadata`` (the
  ``JsonCheckpointHandler``'s default file name) or the name a handler was given
  (``JsonCheckpointHandler(filename=...)``), holding the value as JSON. It is read
  here as a ckptstore `JsonItem`, the way ckptstore keeps configuration items: parsed
  strictly (no duplicate keys, no NaN), at most `jsonitems.MAX_BYTES`, nothing evaluated.

Anything else below a step (``_CHECKPOINT_METADATA``, ``commit_success.txt``, an item of a
handler ckptstore does not read) is not an item here, nor is ``metrics``: Orbax's reserved
item for ``CheckpointManager.save(metrics=...)``, the step's metrics (`read_metrics`).

What the directories hold is checked against what the step's ``_CHECKPOINT_METADATA``
lists (``item_handlers``: each item with the handler that wrote it), so that an item
whose directory was deleted, lost its ``_METADATA`` or was replaced by a file is
`CorruptCheckpointError` naming it (`step_items`), not an item left out without a word.
A step without that listing (an older Orbax, a hand-made step) is read by what is there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.errors import CorruptCheckpointError, NotFoundError, UnsupportedLeafError
from ckptstore.format import jsonitems, layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.layout import ORBAX_CHECKPOINT_METADATA, ORBAX_TREE_METADATA
from ckptstore.orbax.keys import strict_json

#: The file an Orbax ``JsonCheckpointHandler`` writes its value to (its default name).
JSON_FILE = "metadata"
TREE, JSON = "tree", "json"
#: Orbax's reserved item for ``CheckpointManager.save(metrics=...)`` (a JSON value in the
#: file ``metrics/metrics``): the step's metrics, not an item.
METRICS = "metrics"
#: The Orbax handlers (by class name) whose items ckptstore reads, and what each writes.
HANDLER_KINDS = {
    "StandardCheckpointHandler": TREE,
    "PyTreeCheckpointHandler": TREE,
    "JsonCheckpointHandler": JSON,
}


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


async def item_kinds(backend: Backend, where: str) -> dict[str, str]:
    """What the directories of the Orbax step ``where`` hold: name -> `TREE` or `JSON`,
    sorted (``metrics`` among them; unchecked: `step_items` is what readers use)."""
    names = [n for n in await backend.list_dir(where) if layout.is_item(n)]
    kinds = await asyncio.gather(*(_kind(backend, _join(where, n)) for n in names))
    return {n: kind for n, kind in sorted(zip(names, kinds, strict=True)) if kind is not None}


async def _kind(backend: Backend, prefix: str) -> str | None:
    """`TREE` (a ``_METADATA``), `JSON` (one value file) or None: what ``prefix`` holds."""
    if await backend.exists(_join(prefix, ORBAX_TREE_METADATA)):
        return TREE
    return JSON if await json_file(backend, prefix) is not None else None


@dataclass(frozen=True)
class StepMetadata:
    """What ckptstore reads of an Orbax step's ``_CHECKPOINT_METADATA``."""

    #: Each item with its handler's type string (None where Orbax recorded none); None
    #: where the step lists no items (no file, or one tree: a handler name alone).
    handlers: dict[str, str | None] | None
    committed: float | None  # when the step was committed (seconds since the epoch)


async def step_metadata(backend: Backend, where: str) -> StepMetadata:
    """The Orbax step ``where``'s ``_CHECKPOINT_METADATA`` (`parse_step_metadata`); empty
    where there is none."""
    key = _join(where, ORBAX_CHECKPOINT_METADATA)
    try:
        data = await backend.read(key)
    except NotFoundError:
        return StepMetadata(None, None)
    return parse_step_metadata(data, f"{backend.url}/{key}")


def parse_step_metadata(data: bytes, where: str) -> StepMetadata:
    """``_CHECKPOINT_METADATA``, parsed strictly (no duplicate keys, no NaN): an object
    whose ``item_handlers`` is absent, a handler name, or item names (safe ones) mapped to
    handler names or null. Else `CorruptCheckpointError` naming the file and the problem."""
    try:
        doc = strict_json(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        handlers = doc.get("item_handlers")
        if isinstance(handlers, dict):
            for name, handler in handlers.items():
                if not layout.is_item(name):
                    raise ValueError(f"item name {name[:80]!r} is not one ckptstore reads")
                if handler is not None and not isinstance(handler, str):
                    raise ValueError(f"item {name!r} has handler {str(handler)[:80]!r}")
        elif handlers is not None and not isinstance(handlers, str):
            raise ValueError(f"'item_handlers' is {str(handlers)[:80]!r}")
        stamp = doc.get("commit_timestamp_nsecs")
        committed = stamp / 1e9 if type(stamp) is int and stamp >= 0 else None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"unreadable Orbax step metadata {where}: {exc}") from exc
    return StepMetadata(handlers if isinstance(handlers, dict) else None, committed)


async def step_items(backend: Backend, where: str, only: str | None = None) -> dict[str, str]:
    """The items of the Orbax step ``where`` (`item_kinds` less ``metrics``), checked
    against its ``_CHECKPOINT_METADATA``: every item listed there must be a directory
    holding what its handler writes, else `CorruptCheckpointError` naming it. Where
    ``only`` is a listed item, that one alone is checked (a reader who named it needs
    no other); else every listed item is (the reader needs the whole step, or to tell
    which item is meant)."""
    kinds = await item_kinds(backend, where)
    listed = (await step_metadata(backend, where)).handlers or {}
    names = [only] if only in listed else list(listed)
    for name in names:
        if name != METRICS:  # `read_metrics` checks it, for whoever reads it
            await check_listed(backend, where, name, listed[name], kinds.get(name))
    kinds.pop(METRICS, None)
    return kinds


async def check_listed(
    backend: Backend, where: str, name: str, handler: str | None, kind: str | None
) -> None:
    """`CorruptCheckpointError` unless the item ``name``, listed in the step's
    ``_CHECKPOINT_METADATA`` with ``handler``, is a directory holding what that handler
    writes (``kind``: what it holds, as `item_kinds` found; a handler ckptstore does not
    read: anything)."""
    short = (handler or "no handler").rsplit(".", 1)[-1]
    wanted = HANDLER_KINDS.get(short)
    if wanted is not None and kind == wanted:
        return
    prefix = _join(where, name)
    if await backend.exists(prefix):
        problem = "not a directory (a file of that name)"
    elif not await backend.list_dir(prefix):
        problem = "missing (no such directory, or an empty one)"
    elif wanted == TREE:
        problem = f"torn: no {ORBAX_TREE_METADATA} (the tree it saved)"
    elif wanted == JSON:
        problem = "torn: no JSON value file"
    else:
        return
    raise CorruptCheckpointError(
        f"Orbax step {backend.url}/{where}: item {name!r}, which its "
        f"{ORBAX_CHECKPOINT_METADATA} lists ({short}), is {problem}. The step lacks part "
        "of what Orbax saved; read the items still there by naming them (--item NAME, "
        "item=), or bring the item back from a copy"
    )


async def item_names(backend: Backend, where: str) -> list[str]:
    """The tree items (directories with ``_METADATA``) of an Orbax step directory."""
    return [n for n, kind in (await item_kinds(backend, where)).items() if kind == TREE]


async def json_file(backend: Backend, prefix: str) -> str | None:
    """The file of the JSON item whose directory is ``prefix``: `JSON_FILE`, or the
    directory's one file where a handler was given another name; None where ``prefix``
    holds no JSON item (no file, or several)."""
    if await backend.exists(_join(prefix, JSON_FILE)):
        return JSON_FILE
    names = [n for n in await backend.list_dir(prefix) if n != layout.ORBAX_COMMIT_SUCCESS]
    if len(names) == 1 and not names[0].startswith("_"):  # no _METADATA, no ocdbt store
        if await backend.exists(_join(prefix, names[0])):  # a file, not a directory
            return names[0]
    return None


async def read_json_item(backend: Backend, prefix: str) -> JsonItem:
    """The JSON item whose directory is ``prefix``: its value, as ckptstore restores a JSON
    item it saved. `CorruptCheckpointError` for what is not strict JSON (or nests deeper
    than a tree may), `UnsupportedLeafError` for more than `jsonitems.MAX_BYTES`."""
    key = _join(prefix, await json_file(backend, prefix) or JSON_FILE)
    value = await _read_json(backend, key, "Orbax JSON item", allow_nan=False)
    try:
        return JsonItem.from_json(prefix.rsplit("/", 1)[-1], {"value": value})
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"unreadable Orbax JSON item {backend.url}/{key}: {exc}"
        ) from exc


async def read_metrics(backend: Backend, where: str) -> dict[str, Any] | None:
    """The metrics the Orbax step ``where`` was saved with (``save(metrics=...)``, its
    ``metrics`` item), as a ckptstore step keeps them; None where it has none. Checked as
    `step_items` checks an item (listed, it must be there); parsed as Orbax wrote it
    (Python's JSON: a diverged loss is ``NaN``, kept as NaN, as a ckptstore save keeps
    it), duplicate keys refused. Metrics that are not a JSON object are
    `UnsupportedLeafError`: a ckptstore step's metrics are names with values."""
    prefix = _join(where, METRICS)
    kind = await _kind(backend, prefix)
    handlers = (await step_metadata(backend, where)).handlers or {}
    if METRICS in handlers:
        await check_listed(backend, where, METRICS, handlers[METRICS], kind)
    if kind != JSON:
        return None
    key = _join(prefix, await json_file(backend, prefix) or METRICS)
    value = await _read_json(backend, key, "Orbax step metrics", allow_nan=True)
    if not isinstance(value, dict):
        raise UnsupportedLeafError(
            f"Orbax step metrics {backend.url}/{key} are a JSON {type(value).__name__}, not "
            "an object: ckptstore keeps a step's metrics as names with values"
        )
    return value


async def _read_json(backend: Backend, key: str, what: str, *, allow_nan: bool) -> Any:
    """The JSON value in ``key`` (``what`` it is, for messages): at most
    `jsonitems.MAX_BYTES` (else `UnsupportedLeafError`), strict JSON (no duplicate keys;
    NaN only with ``allow_nan``), else `CorruptCheckpointError`."""
    where = f"{backend.url}/{key}"
    size = (await backend.stat(key)).size
    if size > jsonitems.MAX_BYTES:
        raise UnsupportedLeafError(
            f"{what} {where} is {size} bytes, more than the {jsonitems.MAX_BYTES} "
            "ckptstore keeps as a JSON item (a configuration, not data)"
        )
    try:
        return strict_json(await backend.read(key), allow_nan=allow_nan)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"unreadable {what} {where}: {exc}") from exc
