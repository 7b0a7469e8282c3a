"""Finding committed steps and restoring trees from them, onto any mesh.

Restore is strict by default: every leaf the caller asks for must exist with
the same shape and dtype, and (unless ``partial=True``) every stored leaf must
be asked for. All disagreements are reported together in one
`TreeMismatchError`. Casting to another dtype is opt-in (``cast=True``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ckptstore.arrays import ocdbt_spec, open_leaf, read_slice
from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout, orbax
from ckptstore.checkpoint.commit import committed_steps, latest_manifest
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.checkpoint.stored import StoredItem, settle
from ckptstore.checkpoint.target import Target, opened
from ckptstore.checkpoint.tree import path_name, rebuild
from ckptstore.errors import CheckpointNotFoundError, TreeMismatchError
from ckptstore.leaves import LeafInfo


async def list_steps(target: Target) -> list[int]:
    """Committed steps, ascending. Steps without a commit marker are ignored.

    Where there is no committed step, the finalized steps of an Orbax
    `CheckpointManager` root at ``target`` (never its temporary directories).
    """
    async with opened(target) as backend:
        return await committed_steps(backend) or await orbax.finalized_steps(backend)


async def read_manifest(target: Target, step: int | None = None) -> Manifest:
    """The verified manifest of a committed step (the latest when ``step`` is None)."""
    async with opened(target) as backend:
        return await latest_manifest(backend, step)


async def restore(
    target: Target,
    step: int | None = None,
    like: Any = None,
    *,
    item: str = layout.DEFAULT_ITEM,
    partial: bool = False,
    cast: bool = False,
) -> Any:
    """Restore a committed step (the latest by default).

    ``like`` describes what to build: ``None`` gives the saved tree with numpy
    arrays; a tree of `jax.ShapeDtypeStruct` (or arrays) with shardings gives
    jax arrays laid out that way, each process reading only its slices.

    Where ``target`` has no such committed step but holds an Orbax checkpoint (a
    `StandardCheckpointer` directory, or a `CheckpointManager` root with a finalized
    ``step``), that is read instead, with the same semantics.
    """
    async with opened(target) as backend:
        stored = await open_stored(backend, step, item)
        return await restore_stored(stored, like, partial=partial, cast=cast)


async def open_stored(backend: Backend, step: int | None, item: str) -> StoredItem:
    """The item to restore: from a committed ckptstore step, else from an Orbax checkpoint."""
    try:
        manifest = await latest_manifest(backend, step)
    except CheckpointNotFoundError:
        where = await orbax.locate(backend, step)
        if where is None:
            raise
        return await orbax.open_item(backend, where, item, default_item=layout.DEFAULT_ITEM)
    if item not in manifest.items:
        raise CheckpointNotFoundError(
            f"step {manifest.step} has no item {item!r} (it has {sorted(manifest.items)})",
            backend=backend.url,
        )
    store = item_store(backend, manifest, item)
    ctx = backend.ts_context

    async def open_native(info: LeafInfo) -> ts.TensorStore:
        return await open_leaf(store, ctx, info)

    saved = manifest.items[item]
    return StoredItem(saved.leaves, saved.structure, open_native)


async def restore_stored(stored: StoredItem, like: Any, *, partial: bool, cast: bool) -> Any:
    """Build the tree ``like`` asks for (the saved one when None) from ``stored``."""

    async def load(info: LeafInfo, want: Any) -> Any:
        return await _materialize(await stored.open(info), info, want, cast)

    if like is None:
        names = list(stored.leaves)
        values = await settle(load(stored.leaves[n], None) for n in names)
        loaded = dict(zip(names, values, strict=True))
        return rebuild(stored.structure, loaded.__getitem__)

    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    wanted = [(path_name(path), leaf) for path, leaf in paths]
    _check(wanted, stored.leaves, partial=partial, cast=cast)
    values = await settle(load(stored.leaves[n], w) for n, w in wanted)
    return jax.tree_util.tree_unflatten(treedef, values)


def item_store(backend: Backend, manifest: Manifest, item: str) -> dict[str, Any]:
    """The TensorStore spec of one item's merged store in the attempt ``manifest`` describes."""
    where = layout.AttemptDir(manifest.step, manifest.attempt)
    return ocdbt_spec(backend.kvstore_spec(where.item(item)))


def _check(
    wanted: list[tuple[str, Any]], stored: dict[str, LeafInfo], *, partial: bool, cast: bool
) -> None:
    problems = []
    names = {n for n, _ in wanted}
    for name, want in wanted:
        info = stored.get(name)
        if info is None:
            problems.append(f"{name}: not in the checkpoint")
            continue
        shape = _shape_of(want)
        if shape is not None and tuple(shape) != info.shape:
            problems.append(f"{name}: shape {list(shape)} requested, {list(info.shape)} stored")
        dtype = _dtype_of(want)
        if dtype is not None and dtype.name != info.dtype and not cast:
            problems.append(
                f"{name}: dtype {dtype.name} requested, {info.dtype} stored (pass cast=True)"
            )
    if not partial:
        problems += [
            f"{name}: stored but not requested (pass partial=True)"
            for name in sorted(set(stored) - names)
        ]
    if problems:
        raise TreeMismatchError(problems)


def _shape_of(want: Any) -> tuple[int, ...] | None:
    shape = getattr(want, "shape", None)
    return tuple(shape) if shape is not None else (() if _is_number(want) else None)


def _dtype_of(want: Any) -> np.dtype[Any] | None:
    dtype = getattr(want, "dtype", None)
    return np.dtype(dtype) if dtype is not None else None


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex))


async def _materialize(arr: Any, info: LeafInfo, want: Any, cast: bool) -> Any:
    dtype = _dtype_of(want)
    sharding = getattr(want, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return await _read_sharded(arr, info, sharding, dtype if cast else None)
    whole = await read_slice(arr, (), info.name)
    if cast and dtype is not None:
        whole = whole.astype(dtype)
    if want is None:
        if info.python_type:
            return _PYTHON_TYPES[info.python_type](whole[()])
        return whole[()] if info.kind == "scalar" else whole
    if type(want) in _PYTHON_TYPES.values():  # exactly a Python number, not np.float64
        return type(want)(whole[()])
    return whole[()] if isinstance(want, np.generic) else whole


_PYTHON_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "complex": complex}


async def _read_sharded(
    arr: Any, info: LeafInfo, sharding: jax.sharding.Sharding, dtype: np.dtype[Any] | None
) -> jax.Array:
    """Read only the slices this process's devices hold, once per distinct slice."""
    index_map = sharding.addressable_devices_indices_map(info.shape)
    distinct: dict[tuple[tuple[int, int], ...], tuple[slice, ...]] = {}
    for index in index_map.values():
        distinct.setdefault(_key(index, info.shape), tuple(index or ()))
    keys = list(distinct)
    datas = await settle(read_slice(arr, distinct[k], info.name) for k in keys)
    by_key = dict(zip(keys, datas, strict=True))
    shards = []
    for device, index in index_map.items():
        data = by_key[_key(index, info.shape)]
        if dtype is not None:
            data = data.astype(dtype)
        shards.append(jax.device_put(data, device))
    return jax.make_array_from_single_device_arrays(info.shape, sharding, shards)


def _key(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (s.indices(d)[0], s.indices(d)[1]) for s, d in zip(tuple(index), shape, strict=True)
    )
