"""Pytrees <-> named leaves and a JSON description of the tree's structure.

Leaves are named by their path in the tree (``params/dense/kernel``), with each
path segment percent-encoded so any dict key maps to a safe, unique storage
name. The structure is stored as plain JSON (never pickle) so a checkpoint can
be rebuilt without the code that saved it: dicts, lists, tuples, named tuples
and ``None`` come back as they were; other registered pytree nodes come back as
dicts of their children unless the caller passes ``like``.
"""

from __future__ import annotations

import collections
import functools
import keyword
import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, unquote

import jax
import numpy as np

from ckptstore.errors import TreeError
from ckptstore.format.leaves import HostShards

SAFE = "-_.~"  # besides ASCII letters and digits, kept as is in storage names


def is_leaf_value(x: Any) -> bool:
    """Values saved as arrays: jax/numpy arrays (staged ones too), numpy scalars, numbers."""
    return isinstance(x, (jax.Array, HostShards, np.ndarray, np.generic, bool, int, float, complex))


def segment(key: Any) -> str:
    """One path element of a jax key path as a storage-safe string."""
    if isinstance(key, jax.tree_util.DictKey):
        raw = key.key
        if not isinstance(raw, (str, int)) or isinstance(raw, bool):
            raise TreeError(f"dict keys must be str or int to be saved, got {raw!r}")
        text = str(raw)
    elif isinstance(key, jax.tree_util.SequenceKey):
        text = str(key.idx)
    elif isinstance(key, jax.tree_util.GetAttrKey):
        text = key.name
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
        text = str(key.key)
    else:
        text = str(key)
    return _encode(text)


@functools.lru_cache(maxsize=4096)
def _encode(text: str) -> str:
    # Cached: trees repeat their keys (kernel, bias, layer_3) over thousands of leaves,
    # and percent-encoding costs a few microseconds a segment.
    encoded = quote(text, safe=SAFE)
    if encoded in ("", ".", ".."):
        encoded = "%" + "".join(f"{ord(c):02X}" for c in text) if text else "%00"
    return encoded


def path_name(path: tuple[Any, ...]) -> str:
    """The storage name of a leaf: its encoded path segments joined by ``/``."""
    return "/".join(segment(k) for k in path) if path else "%root"


def check_tree(tree: Any) -> None:
    """Check the whole tree, iteratively (a tree nested deeper than Python's stack, or one
    that contains itself, is a `TreeError` too): nesting at most `MAX_DEPTH` levels, what a
    stored structure may hold, and dict keys of one kind, str or int (JAX's flatten sorts
    keys and fails on a mix with an untyped ValueError; ``{1: a, "1": b}`` would also name
    two leaves alike). `flatten` runs it where JAX's flatten fails or the tree is too deep.
    """
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise _too_deep(path)
        if node is None or is_leaf_value(node):
            continue
        if isinstance(node, dict):
            kinds = {_key_kind(k, path) for k in node}
            if len(kinds) > 1:
                raise TreeError(
                    f"the dict at {_where(path)} mixes int and str keys "
                    f"({sorted(map(repr, node))[:4]}): use one kind per dict"
                )
            stack.extend((v, (*path, str(k))) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(node))
        else:
            children, _ = jax.tree_util.tree_flatten_with_path(
                node, is_leaf=lambda x, n=node: x is not n
            )
            if len(children) == 1 and children[0][1] is node:
                continue  # not a pytree node: `flatten` names it if it is no leaf value
            stack.extend((v, (*path, str(p[0]))) for p, v in children)


def _too_deep(path: Sequence[Any]) -> TreeError:
    shown = "/".join(map(str, path[:3]))
    return TreeError(
        f"the tree is nested deeper than {MAX_DEPTH} levels (below {shown!r}/...); a "
        "checkpoint holds at most that many"
    )


def _where(path: tuple[str, ...]) -> str:
    return repr("/".join(path)[:120]) if path else "the root"


def _key_kind(key: Any, path: tuple[str, ...]) -> type:
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise TreeError(
            f"dict keys must be str or int to be saved, got {type(key).__name__} "
            f"{repr(key)[:40]} (in the dict at {_where(path)})"
        )
    return str if isinstance(key, str) else int


def flatten(tree: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf in tree order; ``None`` leaves are skipped.

    The whole tree is checked before anything is written: leaf kinds, name clashes, depth
    and dict keys (`check_tree`, where JAX's flatten fails or a leaf lies too deep;
    `describe` refuses containers nested too deeply that hold no leaf)."""
    try:
        leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    except Exception:  # mixed keys (ValueError), too deep or cyclic (SystemError), ...
        check_tree(tree)  # names the problem as a TreeError
        raise
    if max((len(path) for path, _ in leaves), default=0) > MAX_DEPTH:
        check_tree(tree)
    named = [(path_name(path), leaf) for path, leaf in leaves]
    seen: dict[str, int] = collections.Counter(name for name, _ in named)
    clashes = sorted(name for name, n in seen.items() if n > 1)
    if clashes:
        raise TreeError(f"distinct tree paths map to the same leaf name: {clashes}")
    for name, leaf in named:
        if not is_leaf_value(leaf):
            raise TreeError(
                f"leaf {name!r} is a {type(leaf).__name__}; only arrays and numbers can be saved"
            )
    return named


def describe(tree: Any, name: str = "", depth: int = 0) -> dict[str, Any]:
    """A JSON description of the tree's containers, enough to rebuild it; `TreeError`
    for nesting deeper than `MAX_DEPTH` (what `check_structure` accepts)."""
    if depth > MAX_DEPTH:
        raise _too_deep(name.split("/"))

    def child(key: Any) -> str:
        part = segment(key)
        return f"{name}/{part}" if name else part

    if tree is None:
        return {"t": "none"}
    if is_leaf_value(tree):
        return {"t": "leaf", "name": name or "%root"}
    if isinstance(tree, dict):
        keys = list(tree.keys())
        return {
            "t": "dict",
            "keys": [[type(k).__name__, k] for k in keys],
            "items": [describe(tree[k], child(jax.tree_util.DictKey(k)), depth + 1) for k in keys],
        }
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return {
            "t": "namedtuple",
            "type": type(tree).__name__,
            "fields": list(tree._fields),
            "items": [
                describe(v, child(jax.tree_util.GetAttrKey(f)), depth + 1)
                for f, v in zip(tree._fields, tree, strict=True)
            ],
        }
    if isinstance(tree, (list, tuple)):
        return {
            "t": type(tree).__name__,
            "items": [
                describe(v, child(jax.tree_util.SequenceKey(i)), depth + 1)
                for i, v in enumerate(tree)
            ],
        }
    children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if len(children) == 1 and children[0][1] is tree:
        raise TreeError(f"{name or 'the tree'} is a {type(tree).__name__}, not a pytree or leaf")
    return {
        "t": "custom",
        "type": f"{type(tree).__module__}.{type(tree).__qualname__}",
        "keys": [segment(path[0]) for path, _ in children],
        "items": [describe(v, child(path[0]), depth + 1) for path, v in children],
    }


_SEGMENT = r"(?!\.\.?(?:/|$))[A-Za-z0-9_.~%-]+"  # not "." or ".."
_LEAF_NAME = re.compile(f"{_SEGMENT}(?:/{_SEGMENT})*")


def check_leaf_name(name: Any) -> str:
    """``name`` if `path_name` could have made it (percent-encoded segments joined by
    ``/``, none empty, ``.`` or ``..``), else `TreeError`: a stored name is a path in
    the store, so a hand-edited one must not reach anywhere else."""
    if isinstance(name, str) and _LEAF_NAME.fullmatch(name):
        return name
    raise TreeError(f"bad leaf name {str(name)[:80]!r}: not a stored tree path")


MAX_DEPTH = 200  # far deeper than any real model; deep enough JSON would exhaust the stack


def check_structure(desc: Any) -> set[str]:
    """Check a stored structure is one `rebuild` can use; returns its leaf names.

    Raises `TreeError` naming the first problem (unknown node type, malformed keys,
    a leaf named twice, nesting deeper than `MAX_DEPTH`).
    """
    names: set[str] = set()
    stack: list[tuple[Any, int]] = [(desc, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TreeError(f"the stored tree is nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict) or node.get("t") not in _NODE_TYPES:
            raise TreeError(f"malformed node in the stored tree structure: {str(node)[:80]}")
        kind = node["t"]
        if kind == "leaf":
            name = check_leaf_name(node.get("name"))
            if name in names:
                raise TreeError(f"leaf name {name!r} appears twice in the stored structure")
            names.add(name)
            continue
        items = node.get("items", [])
        if not isinstance(items, list):
            raise TreeError(f"a {kind} node's items are not a list")
        if kind == "dict":
            _check_keys(node.get("keys"), len(items), _is_dict_key)
        elif kind == "namedtuple":
            _check_keys(node.get("fields"), len(items), _is_field)
            if not _is_identifier(node.get("type")):
                raise TreeError(f"bad namedtuple type name {node.get('type')!r}")
        elif kind == "custom":
            _check_keys(node.get("keys"), len(items), lambda k: isinstance(k, str))
        stack.extend((child, depth + 1) for child in items)
    return names


_NODE_TYPES = ("none", "leaf", "dict", "list", "tuple", "namedtuple", "custom")


def check_leaf_paths(desc: dict[str, Any]) -> None:
    """Every leaf of a structure that passed `check_structure` is named by its path, as
    `describe` names it; else `TreeError`. So a key renamed in a stored structure cannot
    quietly hand a leaf to another place of the rebuilt tree."""
    stack: list[tuple[dict[str, Any], str]] = [(desc, "")]
    while stack:
        node, prefix = stack.pop()
        kind = node["t"]
        if kind == "leaf":
            if node["name"] != (prefix or "%root"):
                raise TreeError(f"leaf {node['name']!r} is stored at {prefix or '%root'!r}")
            continue
        items = node.get("items", [])
        if kind == "dict":
            keys = [segment(jax.tree_util.DictKey(k[1])) for k in node["keys"]]
        elif kind == "namedtuple":
            keys = [segment(jax.tree_util.GetAttrKey(f)) for f in node["fields"]]
        elif kind == "custom":
            keys = list(node["keys"])
        else:
            keys = [str(i) for i in range(len(items))]
        stack.extend(
            (c, f"{prefix}/{k}" if prefix else k) for c, k in zip(items, keys, strict=True)
        )


def _check_keys(keys: Any, count: int, ok: Callable[[Any], bool]) -> None:
    if (
        not isinstance(keys, list)
        or len(keys) != count
        or not all(ok(k) for k in keys)
        or len({repr(k) for k in keys}) != count
    ):
        raise TreeError(f"malformed keys in the stored tree structure: {str(keys)[:80]}")


def _is_dict_key(k: Any) -> bool:
    return (
        isinstance(k, list)
        and len(k) == 2
        and (
            (k[0] == "str" and isinstance(k[1], str))
            or (k[0] == "int" and isinstance(k[1], int) and not isinstance(k[1], bool))
        )
    )


def _is_identifier(k: Any) -> bool:
    return isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)


def _is_field(k: Any) -> bool:
    return _is_identifier(k) and not k.startswith("_")


def rebuild(desc: dict[str, Any], leaf: Callable[[str], Any]) -> Any:
    """Rebuild a tree from `describe` output, calling ``leaf(name)`` for each leaf."""
    kind = desc["t"]
    if kind == "none":
        return None
    if kind == "leaf":
        return leaf(desc["name"])
    items = [rebuild(d, leaf) for d in desc.get("items", [])]
    if kind == "dict":
        keys = [int(v) if t == "int" else str(v) for t, v in desc["keys"]]
        return dict(zip(keys, items, strict=True))
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "namedtuple":
        cls = collections.namedtuple(desc["type"], desc["fields"])  # type: ignore[misc]
        return cls(*items)
    if kind == "custom":
        return {unquote(k): v for k, v in zip(desc["keys"], items, strict=True)}
    raise TreeError(f"unknown node type {kind!r} in the stored tree structure")
