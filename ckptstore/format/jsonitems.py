"""Items that are configuration, not arrays: saved as JSON in the step's manifest.

A training run's step often holds, beside its arrays, values that are no arrays at all: a
dataclass config, a dict of hyperparameters with strings in it, a run name. An item whose
leaves are not all arrays and numbers, and that holds only JSON values (``None``, bools,
numbers, strings, lists, tuples, dicts with string keys) and dataclass instances of those, is
saved as JSON inside the manifest: committed, digested and promoted with the step, and read
back without touching the arrays. Nothing is pickled or evaluated, in either direction: a
dataclass is written as the dict of its fields (its type's name is recorded, for messages
only) and comes back as that dict, or as the dataclass ``like=`` names (a class or an
instance), built by calling it with the fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

import jax

from ckptstore.errors import TreeError, TreeMismatchError
from ckptstore.format.tree import MAX_DEPTH, flatten, is_leaf_value

#: The largest JSON item, encoded: a config, not a dataset (arrays go in array items).
MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class JsonItem:
    """One item's JSON value, and the dataclass it was made from (its qualified name)."""

    value: Any
    type: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "type": self.type}

    @classmethod
    def from_json(cls, name: str, doc: Any) -> JsonItem:
        """A manifest's record of item ``name``; ValueError naming what is wrong."""
        if not isinstance(doc, dict) or "value" not in doc:
            raise ValueError(f"JSON item {name!r} is not an object with a value")
        kind = doc.get("type")
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"JSON item {name!r}: bad type name")
        _check(doc["value"], name, 0)
        return cls(doc["value"], kind)


def _check(value: Any, where: str, depth: int) -> None:
    """A stored value is plain JSON (what `json.loads` makes), nested at most `MAX_DEPTH`."""
    if depth > MAX_DEPTH:
        raise ValueError(f"JSON item {where!r} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        for v in value:
            _check(v, where, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _check(v, where, depth + 1)
    elif value is not None and not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"JSON item {where!r} holds a {type(value).__name__}")


def is_array_tree(value: Any) -> bool:
    """Whether ``value`` is saved as arrays: every pytree leaf an array or a number, and
    some leaf an array (jax or numpy, numpy scalars too) or what JSON cannot hold.

    Python values alone (a dict of floats, ints and bools) are configuration: a JSON item.
    That is what restoring a JSON item gives, so saving it again keeps it JSON, and
    ``export-orbax`` writes it as Orbax's ``JsonSave`` (as an array item it went out with
    ``StandardCheckpointHandler``, where the user's ``JsonRestore`` fails). A tree of Python
    numbers that JSON cannot hold (NaN, complex, an int dict key) stays arrays, as before.
    """
    if isinstance(value, JsonItem):
        return False
    try:
        paths = jax.tree_util.tree_flatten_with_path(value)[0]
    except Exception:  # let the array path name what is wrong (mixed keys, cycles)
        return True
    if not all(is_leaf_value(leaf) for _, leaf in paths):
        return False
    if not paths or any(type(leaf) not in _PYTHON_SCALARS for _, leaf in paths):
        return True  # an array, a numpy scalar, a complex: arrays (and an empty tree)
    if any(not isinstance(k, _PLAIN_KEYS) for path, _ in paths for k in path):
        return True  # a named tuple, a registered node: arrays keep what it was
    try:
        _encode(value, (), 0)
    except TreeError:  # NaN, an int key: JSON cannot hold it, arrays can
        return True
    return False


#: The leaves a JSON item's numbers are: a tree of these alone is configuration.
_PYTHON_SCALARS = (bool, int, float)
#: The containers a JSON item is made of (dicts, lists, tuples), as jax names their keys.
_PLAIN_KEYS = (jax.tree_util.DictKey, jax.tree_util.SequenceKey)


def as_json_item(name: str, value: Any) -> JsonItem:
    """``value`` as a JSON item; `TreeError` if it is neither that nor an array tree (a tree
    mixing arrays with strings, say)."""
    if isinstance(value, JsonItem):
        return value
    try:
        doc = _encode(value, (), 0)
    except TreeError as exc:
        try:
            flatten(value)
            as_arrays = "arrays"
        except TreeError as why:  # what saving it as arrays found
            as_arrays = f"arrays: {why}"
        raise TreeError(
            f"item {name!r} is neither {as_arrays} nor JSON ({exc}); save arrays and other "
            "values as separate items (items={'state': ..., 'config': ...}), or the other "
            "values in metadata="
        ) from exc
    size = len(json.dumps(doc, separators=(",", ":")))
    if size > MAX_BYTES:
        raise TreeError(
            f"item {name!r} is {size} bytes of JSON, more than {MAX_BYTES}: save arrays as arrays"
        )
    kind = f"{type(value).__module__}.{type(value).__qualname__}" if _is_dataclass(value) else None
    return JsonItem(doc, kind)


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _encode(value: Any, path: tuple[str, ...], depth: int) -> Any:
    where = "/".join(path) or "the item"
    if depth > MAX_DEPTH:
        raise TreeError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum or a bool subclass: its number
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TreeError(f"{where} is {value}: JSON has no such number")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v, (*path, str(i)), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TreeError(f"{where} has a {type(k).__name__} key {k!r}: JSON keys are str")
            out[k] = _encode(v, (*path, k), depth + 1)
        return out
    if _is_dataclass(value):
        return {
            f.name: _encode(getattr(value, f.name), (*path, f.name), depth + 1)
            for f in dataclasses.fields(value)
        }
    raise TreeError(f"{where} is a {type(value).__name__}: not JSON")


def restore(item: JsonItem, like: Any) -> Any:
    """The stored value (lists, dicts), or built like ``like``: a dataclass (class or
    instance) from its fields, tuples where ``like`` has tuples; `TreeMismatchError` where
    the stored value does not fit."""
    if like is None:
        return item.value
    problems: list[str] = []
    out = _build(item.value, like, "", problems)
    if problems:
        raise TreeMismatchError(problems)
    return out


def _build(value: Any, like: Any, where: str, problems: list[str]) -> Any:
    """``value`` built like ``like``: an instance, or (inside a dataclass given as a class)
    a field's type hint."""
    if dataclasses.is_dataclass(like):
        return _dataclass(value, like, where, problems)
    args = typing.get_args(like)
    origin = typing.get_origin(like)
    if origin in (typing.Union, types.UnionType):  # Optional[Config], Config | None
        if value is None:
            return None
        fits = [a for a in args if _fits(value, a)]
        return _build(value, fits[0], where, problems) if fits else value
    if isinstance(value, list):
        if isinstance(like, tuple) and len(like) == len(value):
            subs: list[Any] = list(like)
        elif origin is tuple and args and args[-1] is not Ellipsis and len(args) == len(value):
            subs = list(args)
        elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            subs = [args[0]] * len(value)
        elif origin is list and len(args) == 1:
            subs = [args[0]] * len(value)
        else:
            return value
        out = [
            _build(v, sub, f"{where}/{i}".lstrip("/"), problems)
            for i, (v, sub) in enumerate(zip(value, subs, strict=True))
        ]
        return out if origin is list else tuple(out)
    if isinstance(value, dict) and isinstance(like, dict):
        return {
            k: _build(v, like.get(k), f"{where}/{k}".lstrip("/"), problems)
            for k, v in value.items()
        }
    return value


def _fits(value: Any, hint: Any) -> bool:
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return isinstance(value, list) and typing.get_origin(hint) in (tuple, list)


def _dataclass(value: Any, like: Any, where: str, problems: list[str]) -> Any:
    shown = where or "the item"
    cls = like if isinstance(like, type) else type(like)
    if not isinstance(value, dict):
        problems.append(f"{shown}: stored {type(value).__name__}, like is {cls.__name__}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    extra = sorted(set(value) - set(fields))
    if extra:
        problems.append(f"{shown}: stored fields {extra} that {cls.__name__} has not")
    hints = _hints(cls) if isinstance(like, type) else {}
    kwargs = {}
    for name in fields:
        if name not in value:
            continue  # its default, or the dataclass's own TypeError below
        sub = hints.get(name) if isinstance(like, type) else getattr(like, name)
        kwargs[name] = _build(value[name], sub, f"{where}/{name}".lstrip("/"), problems)
    if problems:
        return None
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field the stored value lacks
        problems.append(f"{shown}: {cls.__name__}(...) failed: {exc}")
        return None


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types (to build nested configs and tuples)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a forward reference it cannot resolve: fields come back as JSON
        return {}
