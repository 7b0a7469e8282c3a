"""Typed PRNG keys in Orbax 0.12 checkpoints: which arrays hold a key array's data, and of
which implementation (Orbax records it per array in ``array_metadatas/process_<i>``), so that
reading in place and ``import-orbax`` give typed keys and ``export-orbax`` records them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ckptstore.backends.base import Backend
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format.leaves import LeafInfo, key_data_aval
from ckptstore.format.manifest import IMPL_NAME


def strict_json(data: bytes, *, allow_nan: bool = False) -> Any:
    """JSON with no duplicate keys and (unless ``allow_nan``: Orbax's step metrics, which
    Python's JSON writes with them) no NaN/Infinity; ValueError otherwise (Orbax's
    metadata files: `ckptstore.orbax.read` parses ``_METADATA`` with it too)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"duplicate key {key[:80]!r}")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    if allow_nan:
        return json.loads(data, object_pairs_hook=pairs)
    return json.loads(data, object_pairs_hook=pairs, parse_constant=constant)


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


#: Where Orbax records per-array extras, one file per process: a typed PRNG key array's
#: implementation (``ext_metadata: {"random_key_impl": "threefry2x32"}``) among them.
ARRAY_METADATAS = "array_metadatas"
RANDOM_KEY_IMPL = "random_key_impl"


async def key_impls(backend: Backend, prefix: str) -> dict[str, str]:
    """The Orbax arrays below ``prefix`` that hold typed PRNG keys' data, with their
    implementation's name (Orbax's ``array_metadatas/process_<i>``; none before Orbax wrote
    them). Malformed or contradicting records are `CorruptCheckpointError`."""
    folder = _join(prefix, ARRAY_METADATAS)
    names = [n for n in await backend.list_dir(folder) if n.startswith("process_")]
    found: dict[str, str] = {}
    for name in sorted(names):
        key = _join(folder, name)
        try:
            doc = strict_json(await backend.read(key))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{backend.url}/{key}: {exc}") from exc
        records = doc.get("array_metadatas") if isinstance(doc, dict) else None
        if not isinstance(records, list):
            raise CorruptCheckpointError(f"{backend.url}/{key}: no array_metadatas list")
        for record in records:
            meta = record.get("array_metadata") if isinstance(record, dict) else None
            if not isinstance(meta, dict) or not isinstance(meta.get("param_name"), str):
                raise CorruptCheckpointError(f"{backend.url}/{key}: malformed {str(record)[:80]}")
            ext = meta.get("ext_metadata")
            impl = ext.get(RANDOM_KEY_IMPL) if isinstance(ext, dict) else None
            if impl is None:
                continue
            param = meta["param_name"]
            if not (isinstance(impl, str) and IMPL_NAME.fullmatch(impl)):
                raise CorruptCheckpointError(
                    f"{backend.url}/{key}: bad PRNG implementation {str(impl)[:40]!r} for {param!r}"
                )
            if found.setdefault(param, impl) != impl:
                raise CorruptCheckpointError(
                    f"{backend.url}/{folder}: {param!r} is recorded as {found[param]!r} "
                    f"and {impl!r} keys"
                )
    return found


def typed_key(info: LeafInfo, name: str, param: str, impl: str) -> LeafInfo:
    """``info`` of an array Orbax records as typed keys of ``impl``: restored as such."""
    trailing, dtype = key_data_aval(impl)  # UnsupportedLeafError for an unknown one
    rank = len(trailing)
    fits = info.shape[len(info.shape) - rank :] == trailing and len(info.shape) >= rank
    if info.kind != "jax" or not fits or np.dtype(info.dtype) != dtype:
        raise CorruptCheckpointError(
            f"Orbax array {param!r} is recorded as {impl} keys but is a {info.kind} "
            f"{info.dtype} of shape {list(info.shape)}",
            leaf=name,
        )
    return dataclasses.replace(info, prng_impl=impl)
