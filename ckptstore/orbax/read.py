"""Reading Orbax 0.12.x checkpoints in place: no conversion, and no Orbax import.

What is read is one Orbax checkpoint directory (`ckptstore.orbax.steps` finds it: a
`StandardCheckpointer` directory, or one step of a `CheckpointManager` root): ``_METADATA``
(the tree: key paths and value types), ``_CHECKPOINT_METADATA``, and the arrays, either in
one OCDBT store (``manifest.ocdbt``, ``d/``, ``ocdbt.process_<i>/``) or as plain zarr
directories (``use_ocdbt=False``); a step holds one such directory per item (``default/``
or named items; JSON items: `ckptstore.orbax.items`).

Each array is zarr v2 (Orbax's default) or zarr3 under its dot-joined key path
(``params.w/.zarray``). ``_METADATA`` is parsed strictly: anything malformed is a
`CorruptCheckpointError` naming what is wrong. Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.storeditem import StoredItem, settle
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    CorruptCheckpointError,
    TreeError,
    UnsupportedLeafError,
)
from ckptstore.format import layout
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.layout import ORBAX_TREE_METADATA
from ckptstore.format.leaves import LeafInfo, dtype_of
from ckptstore.format.tree import MAX_DEPTH, check_structure, path_name
from ckptstore.orbax.items import JSON, METRICS, TREE, read_json_item, step_items
from ckptstore.orbax.keys import key_impls, strict_json, typed_key
from ckptstore.runtime.gcpause import gc_paused

SEQUENCE, DICT = 1, 2  # Orbax's KeyType values
#: Orbax value types stored as arrays, and the leaf kind each becomes.
ARRAY_KINDS = {"jax.Array": "jax", "np.ndarray": "numpy", "scalar": "scalar"}
#: Orbax value types that store nothing: empty containers and None. Like Orbax
#: itself without rich types, an empty named tuple comes back as None.
EMPTY_NODES: dict[str, dict[str, Any]] = {
    "None": {"t": "none"},
    "NamedTuple": {"t": "none"},
    "Dict": {"t": "dict", "keys": [], "items": []},
    "List": {"t": "list", "items": []},
    "Tuple": {"t": "tuple", "items": []},
}
#: Orbax value types ckptstore knows but does not restore (strings live in ``_strings.json``).
UNSUPPORTED = {"string"}
_PYTHON_TYPES = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


# ---- _METADATA ----


@dataclass(frozen=True)
class Entry:
    """One leaf of Orbax's tree metadata: its key path and what is stored there."""

    keys: tuple[tuple[str, int], ...]  # (name, SEQUENCE | DICT) from the root down
    value_type: str
    write_shape: tuple[int, ...] | None = None  # a jax.Array's shard shape, where recorded

    @property
    def name(self) -> str:
        """The ckptstore leaf name (the one `like` trees are matched by)."""
        path = tuple(
            jax.tree_util.SequenceKey(int(k)) if t == SEQUENCE else jax.tree_util.DictKey(k)
            for k, t in self.keys
        )
        return path_name(path)

    @property
    def param(self) -> str:
        """Orbax's storage name: the keys joined by dots."""
        return ".".join(k for k, _ in self.keys)


@dataclass(frozen=True)
class TreeMetadata:
    entries: list[Entry]
    use_ocdbt: bool | None  # None: not recorded (older Orbax); decided by the files
    use_zarr3: bool
    every_chunk_stored: bool  # store_array_data_equal_to_fill_value: a missing chunk is damage


def parse_tree_metadata(data: bytes, where: str) -> TreeMetadata:
    """Orbax's ``_METADATA``, checked field by field."""
    try:
        doc = strict_json(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        tree = doc.get("tree_metadata")
        if not isinstance(tree, dict):
            raise ValueError("'tree_metadata' is missing or not an object")
        entries = [_entry(label, value, len(tree)) for label, value in tree.items()]
        use_ocdbt = _flag(doc, "use_ocdbt", None)
        return TreeMetadata(
            entries=entries,
            use_ocdbt=use_ocdbt,
            use_zarr3=bool(_flag(doc, "use_zarr3", False)),
            every_chunk_stored=bool(_flag(doc, "store_array_data_equal_to_fill_value", False)),
        )
    except (ValueError, TypeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"unreadable Orbax tree metadata {where}: {exc}") from exc


def _flag(doc: dict[str, Any], key: str, default: bool | None) -> bool | None:
    value = doc.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{key!r} is {str(value)[:40]!r}, not true or false")
    return value


def _entry(label: str, value: Any, count: int) -> Entry:
    """One entry of ``tree_metadata`` (which has ``count`` entries: every element of a
    sequence is described by one at least, so no index reaches ``count``)."""
    if not isinstance(value, dict):
        raise ValueError(f"entry {label[:80]!r} is not an object")
    keys = value.get("key_metadata")
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"entry {label[:80]!r} has no key path")
    if len(keys) > MAX_DEPTH:
        raise ValueError(f"entry {label[:80]!r} is nested deeper than {MAX_DEPTH} levels")
    path = []
    for key in keys:
        if not isinstance(key, dict):
            raise ValueError(f"entry {label[:80]!r}: a key is not an object")
        name, kind = key.get("key"), key.get("key_type")
        if not isinstance(name, str) or type(kind) is not int or kind not in (SEQUENCE, DICT):
            raise ValueError(f"entry {label[:80]!r}: bad key {str(key)[:80]}")
        if kind == SEQUENCE and layout.parse_step(name) is None:  # a plain decimal index
            raise ValueError(f"entry {label[:80]!r}: sequence index {name[:40]!r}")
        if kind == SEQUENCE and (len(name) > 18 or int(name) >= count):  # no huge int()
            raise ValueError(
                f"entry {label[:80]!r}: sequence index {name[:40]!r} beyond the {count} "
                "entries a sequence could have"
            )
        path.append((name, kind))
    meta = value.get("value_metadata")
    if not isinstance(meta, dict):
        raise ValueError(f"entry {label[:80]!r} has no value metadata")
    value_type = meta.get("value_type")
    if not isinstance(value_type, str):
        raise ValueError(f"entry {label[:80]!r} has no value type")
    if value_type not in {*ARRAY_KINDS, *EMPTY_NODES, *UNSUPPORTED}:
        raise ValueError(f"entry {label[:80]!r} has unknown value type {value_type[:40]!r}")
    if not isinstance(meta.get("skip_deserialize", False), bool):
        raise ValueError(f"entry {label[:80]!r}: skip_deserialize is not true or false")
    write_shape = meta.get("write_shape")
    if write_shape is not None and (
        not isinstance(write_shape, list)
        or len(write_shape) > 64
        or not all(type(d) is int and 0 <= d < 2**62 for d in write_shape)
    ):
        raise ValueError(f"entry {label[:80]!r}: bad write_shape {str(write_shape)[:80]}")
    return Entry(tuple(path), value_type, None if write_shape is None else tuple(write_shape))


# ---- the tree structure ----


class _Node:
    def __init__(self) -> None:
        self.key_type: int | None = None
        self.children: dict[str, _Node] = {}
        self.value: dict[str, Any] | None = None


def build_structure(entries: list[Entry]) -> dict[str, Any]:
    """The tree structure (`ckptstore.format.tree` format) the entries describe.

    Orbax records sequences without saying list or tuple; they come back as lists,
    as from Orbax itself. Dict keys come back as strings.
    """
    root = _Node()
    for entry in entries:
        node = root
        for key, key_type in entry.keys:
            if node.value is not None:
                raise ValueError(f"{entry.name!r} lies below a stored value")
            if node.key_type not in (None, key_type):
                raise ValueError(f"{entry.name!r}: one container holds both indices and keys")
            node.key_type = key_type
            node = node.children.setdefault(key, _Node())
        if node.value is not None or node.children:
            raise ValueError(f"{entry.name!r} is described twice")
        if entry.value_type in ARRAY_KINDS:
            node.value = {"t": "leaf", "name": entry.name}
        elif entry.value_type in EMPTY_NODES:
            node.value = EMPTY_NODES[entry.value_type]
        else:
            raise ValueError(f"{entry.name!r} has value type {entry.value_type!r}")
    return _describe(root)


def _describe(node: _Node) -> dict[str, Any]:
    if node.value is not None:
        return node.value
    if node.key_type == SEQUENCE:
        if sorted(map(int, node.children)) != list(range(len(node.children))):
            raise ValueError(f"a sequence has indices {sorted(map(int, node.children))[:20]}")
        return {
            "t": "list",
            "items": [_describe(node.children[str(i)]) for i in range(len(node.children))],
        }
    return {
        "t": "dict",
        "keys": [["str", k] for k in node.children],
        "items": [_describe(child) for child in node.children.values()],
    }


# ---- opening ----


async def open_item(
    backend: Backend, where: str, item: str, *, default_item: str
) -> StoredItem | JsonItem:
    """The item ``item`` of the Orbax checkpoint at ``where`` (from `locate`): a tree item's
    arrays, or a JSON item's value (``ocp.args.JsonSave``, `ckptstore.orbax.items`). An item
    the step's ``_CHECKPOINT_METADATA`` lists but that is missing or torn is
    `CorruptCheckpointError` naming it (`step_items`), when it is the one asked for or when
    the step's lone tree is (which another tree, torn, would make ambiguous).

    A `StandardCheckpointer` directory is one item, read under the default item name;
    a step with a single tree item (``default``) is read under the default name too.
    """
    place = f"{backend.url}/{where}" if where else backend.url
    if await backend.exists(_join(where, ORBAX_TREE_METADATA)):  # the directory is the item
        if item != default_item:
            raise CheckpointNotFoundError(
                f"{place} is one Orbax checkpoint without items; restore it without item=",
                backend=backend.url,
            )
        chosen = ""
    else:
        kinds = await step_items(backend, where, only=item)  # a torn item: named, raised
        trees = [n for n, kind in kinds.items() if kind == TREE]
        if item in kinds:
            chosen = item
        elif item == default_item and len(trees) == 1:
            chosen = trees[0]
        else:
            metrics = " (Orbax's metrics item is the step's metrics: metrics(step))"
            raise CheckpointNotFoundError(
                f"Orbax checkpoint {place} has no item {item!r} (it has {list(kinds)}): "
                f"name one with item={metrics if item == METRICS else ''}",
                backend=backend.url,
            )
        if kinds[chosen] == JSON:
            return await read_json_item(backend, _join(where, chosen))
    return await _open_tree(backend, place, _join(where, chosen))


async def _open_tree(backend: Backend, place: str, prefix: str) -> StoredItem:
    """The tree item whose directory is ``prefix`` (``place``: the checkpoint, for messages)."""
    meta_key = _join(prefix, ORBAX_TREE_METADATA)
    meta_at = f"{backend.url}/{meta_key}"
    data = await backend.read(meta_key)
    with gc_paused():  # an object per field of thousands of leaves: see `gcpause`
        meta = parse_tree_metadata(data, meta_at)
    unsupported = sorted(
        f"{e.name} ({e.value_type})" for e in meta.entries if e.value_type in UNSUPPORTED
    )
    if unsupported:
        raise UnsupportedLeafError(
            f"Orbax checkpoint {place} holds leaves ckptstore does not restore: "
            + ", ".join(unsupported[:10])
        )
    try:
        structure = build_structure(meta.entries)
        check_structure(structure)
    except (ValueError, TreeError) as exc:
        raise CorruptCheckpointError(f"Orbax tree metadata {meta_at}: {exc}") from exc
    arrays = [e for e in meta.entries if e.value_type in ARRAY_KINDS]
    _check_params(arrays, meta_at)
    use_ocdbt = meta.use_ocdbt
    if use_ocdbt is None:  # not recorded: an older Orbax
        use_ocdbt = await backend.exists(_join(prefix, "manifest.ocdbt"))
    elif use_ocdbt and arrays and not await backend.exists(_join(prefix, "manifest.ocdbt")):
        raise CorruptCheckpointError(
            f"Orbax checkpoint {place} records OCDBT but has no {_join(prefix, 'manifest.ocdbt')}"
        )
    reader = _Reader(backend, prefix, use_ocdbt, meta.use_zarr3, meta.every_chunk_stored)
    opened = await settle(reader.open(entry) for entry in arrays)
    await _check_declared(
        backend,
        prefix,
        use_ocdbt,
        meta.every_chunk_stored,
        [(entry, info) for entry, (info, _) in zip(arrays, opened, strict=True)],
    )
    impls = await key_impls(backend, prefix)
    opened = [
        (typed_key(info, entry.name, entry.param, impls[entry.param]), arr)
        if entry.param in impls
        else (info, arr)
        for entry, (info, arr) in zip(arrays, opened, strict=True)
    ]
    leaves = {info.name: info for info, _ in opened}
    stores = {info.name: arr for info, arr in opened}

    async def open_leaf(info: LeafInfo) -> ts.TensorStore:
        return stores[info.name]

    return StoredItem(leaves, structure, open_leaf)


#: No codec Orbax writes packs more bytes than this into one stored byte: zstd (Orbax's
#: default) at most ~32768 (a 128 KiB block as a 4-byte RLE block), deflate ~1032, lz4 ~255.
MAX_COMPRESSION = 1 << 16
#: Arrays declaring more bytes than this are checked against the bytes stored (a listing).
CHECK_STORED_ABOVE = 64 << 20
#: More than any array can hold (TensorStore's indices are int64).
MAX_DECLARED_BYTES = 1 << 62
_METADATA_NAMES = frozenset({".zarray", ".zattrs", ".zgroup", "zarr.json"})


async def _check_declared(
    backend: Backend,
    prefix: str,
    ocdbt: bool,
    every_chunk: bool,
    opened: list[tuple[Entry, LeafInfo]],
) -> None:
    """Each array's declared size against the bytes stored, before any buffer is sized
    by it (a ``.zarray`` edited to declare ``[2**34]`` would otherwise size a 128 GiB
    read, and a failed allocation in TensorStore aborts the process).

    An array declaring more than `CHECK_STORED_ABOVE` bytes must have stored at least
    1/`MAX_COMPRESSION` of them (in an OCDBT store: the whole store's files, an upper
    bound), and, as a plain zarr directory where Orbax stored every chunk, a chunk file
    for each chunk its grid has. Else `CorruptCheckpointError`, naming both sizes.
    """
    whole: int | None = None
    for entry, info in opened:
        if info.nbytes <= CHECK_STORED_ABOVE:
            continue
        chunks: int | None = None
        if ocdbt:
            if whole is None:
                whole = sum([o.size async for o in backend.list(prefix)])
            stored = whole
        else:
            data = [
                o
                async for o in backend.list(_join(prefix, entry.param))
                if o.key.rsplit("/", 1)[-1] not in _METADATA_NAMES
            ]
            stored, chunks = sum(o.size for o in data), len(data)
        grid = math.prod(-(-d // c) for d, c in zip(info.shape, info.chunk_shape, strict=True))
        declared = (
            f"Orbax array {entry.param!r} declares shape {list(info.shape)} of {info.dtype} "
            f"({info.nbytes} bytes"
        )
        if every_chunk and chunks is not None and grid > chunks:
            raise CorruptCheckpointError(
                f"{declared}, {grid} chunks) but {chunks} chunk(s) are stored", leaf=entry.name
            )
        if info.nbytes > stored * MAX_COMPRESSION:
            raise CorruptCheckpointError(
                f"{declared}) but {stored} bytes are stored: no codec compresses "
                f"{MAX_COMPRESSION}:1, the declared size is impossible",
                leaf=entry.name,
            )


def _check_params(entries: list[Entry], where: str) -> None:
    seen: dict[str, str] = {}
    for entry in entries:
        other = seen.setdefault(entry.param, entry.name)
        if other != entry.name:
            raise CorruptCheckpointError(
                f"Orbax tree metadata {where}: leaves {other!r} and {entry.name!r} "
                f"are both stored as {entry.param!r}"
            )


class _Reader:
    """Opens one Orbax item's arrays through the backend's kvstore spec and context."""

    def __init__(
        self, backend: Backend, prefix: str, ocdbt: bool, zarr3: bool, every_chunk: bool
    ) -> None:
        self.backend, self.prefix = backend, prefix
        self.ocdbt, self.zarr3, self.every_chunk = ocdbt, zarr3, every_chunk

    def spec(self, entry: Entry) -> dict[str, Any]:
        if self.ocdbt:
            base = self.backend.kvstore_spec(self.prefix)
            kvstore = {"driver": "ocdbt", "base": base, "path": entry.param + "/"}
        else:
            kvstore = self.backend.kvstore_spec(_join(self.prefix, entry.param))
        return {
            "driver": "zarr3" if self.zarr3 else "zarr",
            "kvstore": kvstore,
            # Orbax writes every chunk (store_array_data_equal_to_fill_value): then a
            # missing chunk is damage, not zeros.
            "fill_missing_data_reads": not self.every_chunk,
        }

    async def open(self, entry: Entry) -> tuple[LeafInfo, ts.TensorStore]:
        try:
            arr = await ts.open(
                self.spec(entry), open=True, read=True, context=self.backend.ts_context
            )
        except CkptStoreError as exc:  # a key the backend refuses (``..`` and the like)
            raise CorruptCheckpointError(f"bad Orbax array name: {exc}", leaf=entry.name) from exc
        except Exception as exc:  # TensorStore raises ValueError for most failures
            raise CorruptCheckpointError(
                f"cannot open Orbax array {entry.param!r} below "
                f"{self.backend.url}/{self.prefix}: {str(exc)[:300]}",
                leaf=entry.name,
            ) from exc
        info = _leaf_info(entry, arr)
        if not self.zarr3:
            _check_zarr2(entry, info, arr.spec().to_json().get("metadata", {}))
        return info, arr


def _check_zarr2(entry: Entry, info: LeafInfo, metadata: dict[str, Any]) -> None:
    """What Orbax writes, checked against an array's ``.zarray`` (zarr v2 has no checksum,
    so an edited one would restore different data silently): C order (``F`` restores
    transposed), chunks no larger than the array (they are its shards, or parts of them: a
    shape edited smaller would restore truncated), and the shard shape ``_METADATA``
    records for a jax.Array, which the shape must hold. A dtype edited to another of the
    same size cannot be caught: nothing else records it."""
    order = metadata.get("order", "C")
    if order != "C":
        raise CorruptCheckpointError(
            f"Orbax array {entry.param!r} has order {str(order)[:8]!r}: Orbax writes C "
            "order, so the .zarray was edited (F would restore the array transposed)",
            leaf=entry.name,
        )
    shape = info.shape
    if any(c > d > 0 for c, d in zip(info.chunk_shape, shape, strict=True)):
        raise CorruptCheckpointError(
            f"Orbax array {entry.param!r} has chunks {list(info.chunk_shape)} larger than "
            f"its shape {list(shape)}: Orbax writes chunks that fit (a shape edited smaller?)",
            leaf=entry.name,
        )
    recorded = entry.write_shape
    if recorded is not None and (
        len(recorded) != len(shape) or any(w > d for w, d in zip(recorded, shape, strict=False))
    ):
        raise CorruptCheckpointError(
            f"Orbax array {entry.param!r} has shape {list(shape)}, but _METADATA records "
            f"shards of {list(recorded)}",
            leaf=entry.name,
        )


def _leaf_info(entry: Entry, arr: ts.TensorStore) -> LeafInfo:
    shape = tuple(int(d) for d in arr.shape)
    dtype = dtype_of(arr.dtype.name)
    kind = ARRAY_KINDS[entry.value_type]
    python_type = None
    if kind == "scalar":
        if shape != ():
            raise CorruptCheckpointError(
                f"Orbax scalar stored with shape {list(shape)}", leaf=entry.name
            )
        python_type = _PYTHON_TYPES.get(dtype.kind)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_DECLARED_BYTES:
        raise CorruptCheckpointError(
            f"Orbax array {entry.param!r} declares shape {list(shape)} of {dtype} "
            f"({nbytes} bytes): impossible",
            leaf=entry.name,
        )
    chunk = arr.chunk_layout.read_chunk.shape or shape
    return LeafInfo(
        name=entry.name,
        shape=shape,
        dtype=np.dtype(dtype).name,
        chunk_shape=tuple(int(c or d) for c, d in zip(chunk, shape, strict=True)),
        kind=kind,
        python_type=python_type,
    )
