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
handler ckptstore does not read) is not an item here.
"""

from __future__ import annotations

import asyncio

from ckptstore.backends.base import Backend
from ckptstore.errors import CorruptCheckpointError, UnsupportedLeafError
from ckptstore.format import jsonitems, layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.orbax.keys import strict_json

#: The file an Orbax ``JsonCheckpointHandler`` writes its value to (its default name).
JSON_FILE = "metadata"
TREE, JSON = "tree", "json"


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


async def item_kinds(backend: Backend, where: str) -> dict[str, str]:
    """The items of the Orbax step directory ``where``: name -> `TREE` or `JSON`, sorted."""
    names = [n for n in await backend.list_dir(where) if layout.is_item(n)]
    trees = await asyncio.gather(
        *(backend.exists(_join(where, n, layout.ORBAX_TREE_METADATA)) for n in names)
    )
    jsons = await asyncio.gather(
        *(
            json_file(backend, _join(where, n))
            for n, tree in zip(names, trees, strict=True)
            if not tree
        )
    )
    found = iter(file is not None for file in jsons)
    kinds = {}
    for name, tree in zip(names, trees, strict=True):
        if tree:
            kinds[name] = TREE
        elif next(found):
            kinds[name] = JSON
    return dict(sorted(kinds.items()))


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
    where = f"{backend.url}/{key}"
    size = (await backend.stat(key)).size
    if size > jsonitems.MAX_BYTES:
        raise UnsupportedLeafError(
            f"Orbax JSON item {where} is {size} bytes, more than the {jsonitems.MAX_BYTES} "
            "ckptstore keeps as a JSON item (a configuration, not data)"
        )
    try:
        value = strict_json(await backend.read(key))
        return JsonItem.from_json(prefix.rsplit("/", 1)[-1], {"value": value})
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"unreadable Orbax JSON item {where}: {exc}") from exc
