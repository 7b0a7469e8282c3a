"""The small JSON files Orbax 0.12 needs beside a checkpoint's arrays, built from a manifest.

Orbax names each array by its tree keys joined with dots (``params.w``) and describes
the tree in ``_METADATA`` (every leaf's key path and value type, plus empty containers
and ``None``); ``_CHECKPOINT_METADATA`` names the handler that wrote the item. The
arrays themselves stay ckptstore's zarr3 arrays (``use_zarr3: true``), which Orbax
reads as they are. The mapping is the inverse of `ckptstore.orbax.read`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ckptstore.errors import OrbaxExportError, UnsupportedLeafError
from ckptstore.format.leaves import LeafInfo
from ckptstore.orbax.keys import RANDOM_KEY_IMPL
from ckptstore.orbax.read import DICT, SEQUENCE

#: What ckptstore leaf kinds are, in Orbax's value types.
VALUE_TYPES = {"jax": "jax.Array", "numpy": "np.ndarray", "scalar": "scalar"}
#: Orbax's value types for containers that hold nothing.
EMPTY_TYPES = {"dict": "Dict", "list": "List", "tuple": "Tuple", "namedtuple": "NamedTuple"}
HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
#: Orbax's item name in a `CheckpointManager` step holding one tree.
DEFAULT_ITEM = "default"


@dataclass(frozen=True)
class OrbaxEntry:
    """One entry of Orbax's tree metadata: a key path, its value type, the leaf stored there."""

    keys: tuple[tuple[str, int], ...]  # (key, SEQUENCE | DICT) from the root down
    value_type: str
    leaf: str | None  # the ckptstore leaf name; None for an empty container or None

    @property
    def param(self) -> str:
        """Orbax's storage name: the keys joined by dots."""
        return ".".join(k for k, _ in self.keys)


def entries(structure: dict[str, Any], leaves: dict[str, LeafInfo]) -> list[OrbaxEntry]:
    """Orbax's tree entries for a stored structure, in tree order.

    Refuses what Orbax cannot name unambiguously: a tree that is one bare leaf, and
    two leaves whose dot-joined names collide (``{"a.b": x, "a": {"b": y}}``).
    """
    out: list[OrbaxEntry] = []
    stack: list[tuple[dict[str, Any], tuple[tuple[str, int], ...]]] = [(structure, ())]
    while stack:
        node, keys = stack.pop()
        kind = node["t"]
        if kind == "leaf":
            if not keys:
                raise OrbaxExportError("Orbax cannot name a tree that is a single bare leaf")
            info = leaves[node["name"]]
            # Like Orbax's own save: Python numbers are "scalar", numpy scalars 0-d arrays;
            # Orbax's scalar handler has no complex, so a Python complex is a 0-d array.
            numpy_scalar = info.kind == "scalar" and info.python_type in (None, "complex")
            value_type = "np.ndarray" if numpy_scalar else VALUE_TYPES[info.kind]
            out.append(OrbaxEntry(keys, value_type, info.name))
            continue
        if kind == "none":
            out.append(OrbaxEntry(keys, "None", None))
            continue
        items = node.get("items", [])
        if not items:
            if not keys:
                raise OrbaxExportError("the tree holds no leaves")
            out.append(OrbaxEntry(keys, EMPTY_TYPES.get(kind, "Dict"), None))
            continue
        if kind in ("list", "tuple"):
            children = [(str(i), SEQUENCE) for i in range(len(items))]
        elif kind == "dict":
            children = [(str(k), DICT) for _, k in node["keys"]]
        elif kind == "namedtuple":
            children = [(f, DICT) for f in node["fields"]]
        else:  # "custom": its children by their (decoded) key names
            children = [(unquote(k), DICT) for k in node["keys"]]
        for child, key in reversed(list(zip(items, children, strict=True))):
            stack.append((child, (*keys, key)))
    _check_unique(out)
    return out


def _check_unique(found: list[OrbaxEntry]) -> None:
    seen: dict[str, str] = {}
    for entry in found:
        name = entry.leaf or repr(entry.keys)
        other = seen.setdefault(entry.param, name)
        if other != name:
            raise OrbaxExportError(
                f"leaves {other!r} and {name!r} would both be Orbax's {entry.param!r}: "
                "Orbax joins keys with dots, so keys containing dots can collide"
            )
        if entry.leaf is not None and (entry.param in (".", "..") or "\\" in entry.param):
            raise UnsupportedLeafError(
                f"leaf {entry.leaf!r} has Orbax name {entry.param!r}, which is not a safe path"
            )


def tree_metadata(found: list[OrbaxEntry]) -> bytes:
    """Orbax's ``_METADATA``: the entries, and arrays recorded as zarr3 in OCDBT."""
    tree = {
        str(tuple(k for k, _ in e.keys)): {
            "key_metadata": [{"key": k, "key_type": t} for k, t in e.keys],
            # Orbax marks empty containers and None as nothing to read.
            "value_metadata": {"value_type": e.value_type, "skip_deserialize": e.leaf is None},
        }
        for e in found
    }
    doc = {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    return json.dumps(doc).encode()


def array_metadatas(found: list[OrbaxEntry], leaves: dict[str, LeafInfo]) -> bytes | None:
    """Orbax's ``array_metadatas/process_0`` for the typed PRNG key arrays among ``found``
    (their implementation, which Orbax restores them with); None where there are none."""
    records = [
        {
            "array_metadata": {
                "param_name": e.param,
                "write_shape": list(leaves[e.leaf].chunk_shape),
                "chunk_shape": list(leaves[e.leaf].chunk_shape),
                "ext_metadata": {RANDOM_KEY_IMPL: leaves[e.leaf].prng_impl},
            }
        }
        for e in found
        if e.leaf is not None and leaves[e.leaf].prng_impl is not None
    ]
    return json.dumps({"array_metadatas": records}).encode() if records else None


def checkpoint_metadata(*, handlers: dict[str, str] | None, manager: bool, started: float) -> bytes:
    """``_CHECKPOINT_METADATA``: of a Composite step (``handlers``: each item's handler),
    else of a `CheckpointManager` step (one ``default`` item) or of a
    `StandardCheckpointer` directory."""
    if handlers is None:  # one tree
        handlers = {DEFAULT_ITEM: HANDLER} if manager else None
    doc = {
        "item_handlers": handlers or HANDLER,
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": int(started * 1e9),
        "commit_timestamp_nsecs": time.time_ns(),
        "custom_metadata": {},
    }
    return json.dumps(doc).encode()
