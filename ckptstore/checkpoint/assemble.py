"""Building the tree a restore asks for from a stored item: checks, reads, placement.

`restore_stored` is the half of a restore after the item is found (`ckptstore.checkpoint.
restore` finds it, on one backend or through a tier or an Orbax reader): it checks what is
asked for against what is stored (every disagreement in one `TreeMismatchError`), reads each
leaf's slices within a byte budget, and hands each slice to its devices as soon as it is
read. Typed PRNG keys are read as their key data and wrapped.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ckptstore.checkpoint.storeditem import Read, StoredItem, settle
from ckptstore.datapath import placement
from ckptstore.datapath.reads import read_slice

# A restore reads at most this many bytes ahead of handing them to the devices (or the
# caller): it needs about this plus its largest shard over the restored state.
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES
from ckptstore.errors import CorruptCheckpointError, TreeMismatchError
from ckptstore.format import chunks
from ckptstore.format.leaves import (
    Index,
    LeafInfo,
    dtype_of,
    is_key_like,
    key_data_aval,
    key_impl_name,
)
from ckptstore.format.tree import path_name, rebuild
from ckptstore.runtime.bytebudget import ByteBudget
from ckptstore.runtime.hostpool import pooled
from ckptstore.runtime.membudget import check_fits


async def restore_stored(
    stored: StoredItem,
    like: Any,
    *,
    partial: bool,
    cast: bool,
    budget: ByteBudget | None = None,
) -> Any:
    """Build the tree ``like`` asks for (the saved one when None) from ``stored``.

    Onto accelerators, the bytes read land in reused host buffers (`pooled`): what is read
    ahead is bounded by ``budget``, so the pool keeps up to twice that and reuses it."""
    budget = budget or ByteBudget(MAX_INFLIGHT_BYTES)
    if not _onto_accelerators(like):
        return await _restore_stored(stored, like, partial=partial, cast=cast, budget=budget)
    with pooled(2 * budget.limit):
        return await _restore_stored(stored, like, partial=partial, cast=cast, budget=budget)


def _onto_accelerators(like: Any) -> bool:
    """Whether ``like`` puts some leaf on devices other than CPUs."""
    shardings = {getattr(leaf, "sharding", None) for leaf in jax.tree_util.tree_leaves(like)}
    return any(
        isinstance(s, jax.sharding.Sharding) and not placement.on_host(list(s.device_set))
        for s in shardings
    )


async def _restore_stored(
    stored: StoredItem, like: Any, *, partial: bool, cast: bool, budget: ByteBudget
) -> Any:
    if like is None:
        names = list(stored.leaves)
        # Typed PRNG keys come back as typed keys of the implementation they were saved from.
        stored_keys = {
            n: _KeysWanted.of_stored(info)
            for n, info in stored.leaves.items()
            if info.prng_impl is not None
        }
        values = await _load(stored, [(stored.leaves[n], None) for n in names], cast, budget)
        loaded = dict(zip(names, values, strict=True))
        for name, key in stored_keys.items():
            loaded[name] = key.wrap(loaded[name])
        return rebuild(stored.structure, loaded.__getitem__)

    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    wanted = [(path_name(path), leaf) for path, leaf in paths]
    # Typed PRNG keys asked for: their key data is read, then wrapped.
    keys = {k: _KeysWanted.of(w) for k, (_, w) in enumerate(wanted) if is_key_like(w)}
    data = [(n, keys[k].data if k in keys else w) for k, (n, w) in enumerate(wanted)]
    impls = {wanted[k][0]: key.impl for k, key in keys.items()}
    _check(data, stored.leaves, partial=partial, cast=cast, impls=impls)
    values = await _load(stored, [(stored.leaves[n], w) for n, w in data], cast, budget)
    for k, key in keys.items():
        values[k] = key.wrap(values[k])
    return jax.tree_util.tree_unflatten(treedef, values)


@dataclass(frozen=True)
class _KeysWanted:
    """Typed PRNG keys to restore: the key data to read (``data``) and how to make keys
    of it (`wrap`)."""

    impl: str
    data: _Data
    #: Where to put the keys once wrapped: a sharding that does not apply to the key data
    #: as it is (the data is then read to host memory first). None: the data's own place.
    place: jax.sharding.Sharding | None = None

    @classmethod
    def of(cls, want: Any) -> _KeysWanted:
        """For ``want``, a typed key array or `jax.ShapeDtypeStruct` of ``like``."""
        impl = key_impl_name(want.dtype)
        trailing, dtype = key_data_aval(impl)
        shape = (*want.shape, *trailing)
        sharding = getattr(want, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            return cls(impl, _Data(shape, dtype))
        # These leave trailing dimensions unsharded: the keys' sharding is the data's.
        if isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
            return cls(impl, _Data(shape, dtype, sharding))
        return cls(impl, _Data(shape, dtype), place=sharding)

    @classmethod
    def of_stored(cls, info: LeafInfo) -> _KeysWanted:
        """For a stored key leaf restored without ``like``."""
        assert info.prng_impl is not None
        trailing, dtype = key_data_aval(info.prng_impl)
        n = len(trailing)
        if info.shape[len(info.shape) - n :] != trailing or info.dtype != dtype.name:
            raise CorruptCheckpointError(
                f"{info.dtype} data of shape {list(info.shape)} are not "
                f"keys of {info.prng_impl!r} (their data is {dtype.name}, shape [..., "
                f"{', '.join(map(str, trailing))}])",
                leaf=info.name,
            )
        return cls(info.prng_impl, _Data(info.shape, dtype))

    def wrap(self, data: Any) -> jax.Array:
        keys: jax.Array = jax.random.wrap_key_data(data, impl=self.impl)
        return keys if self.place is None else jax.device_put(keys, self.place)


@dataclass(frozen=True)
class _Data:
    """Key data to read, as a ``like`` leaf asks for it (shape, dtype, sharding)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sharding: jax.sharding.Sharding | None = None


async def _load(
    stored: StoredItem, wanted: list[tuple[LeafInfo, Any]], cast: bool, budget: ByteBudget
) -> list[Any]:
    """The value of each (stored leaf, requested form) pair, in order.

    Small single-chunk leaves are read in batches where the format allows it
    (`StoredItem.read_small`); every other leaf through its TensorStore array.
    """
    out: list[Any] = [None] * len(wanted)
    batched = stored.read_small is not None
    small = [(info, k) for k, (info, _) in enumerate(wanted) if batched and chunks.small(info)]
    in_batches = {k for _, k in small}

    # Each leaf read on its own first has its zarr.json checked: tiny reads, done before
    # the batches' large reads start, which they would otherwise queue behind.
    alone = [k for k in range(len(wanted)) if k not in in_batches]
    opened: dict[int, Read | None] = {}
    if stored.open_raw is not None and alone:
        raws = await stored.open_raw([wanted[k][0] for k in alone])
        opened = dict(zip(alone, raws, strict=True))

    async def one(k: int) -> None:
        info, want = wanted[k]
        read = opened.get(k)
        if read is None:
            arr = await stored.open(info)

            async def read(index: Index) -> np.ndarray[Any, Any]:
                return await read_slice(arr, index, info.name)

        out[k] = await _materialize(read, info, want, cast, budget)

    async def batch(group: list[tuple[LeafInfo, int]]) -> None:
        assert stored.read_small is not None
        async with budget.hold(sum(info.nbytes for info, _ in group)):
            wholes = await stored.read_small([info for info, _ in group])
            onto: list[tuple[int, np.ndarray[Any, Any], jax.sharding.Sharding]] = []
            for (info, k), whole in zip(group, wholes, strict=True):
                want = wanted[k][1]
                sharding = getattr(want, "sharding", None)
                # Not across processes: jax.device_put would compare the value between them.
                if isinstance(sharding, jax.sharding.Sharding) and sharding.is_fully_addressable:
                    dtype, cast_it = _target(want, info, cast)
                    onto.append((k, whole.astype(dtype) if cast_it and dtype else whole, sharding))
                else:
                    out[k] = await _materialize(in_memory(whole), info, want, cast, None)
            if onto:  # one transfer for the whole batch: most of the cost is per call
                placed = await placement.put_many([v for _, v, _ in onto], [s for *_, s in onto])
                for (k, _, _), array in zip(onto, placed, strict=True):
                    out[k] = array

    groups = chunks.groups(small, budget.limit // 4)
    await settle([*map(one, alone), *map(batch, groups)])
    return out


def in_memory(whole: np.ndarray[Any, Any]) -> Read:
    async def read(index: Index) -> np.ndarray[Any, Any]:
        return whole[index] if index else whole  # a 0-d array[()] would be a scalar

    return read


def _check(
    wanted: list[tuple[str, Any]],
    stored: dict[str, LeafInfo],
    *,
    partial: bool,
    cast: bool,
    impls: dict[str, str],
) -> None:
    """Every disagreement between what is asked for and what is stored, in one
    `TreeMismatchError`. ``impls``: the leaves asked for as typed PRNG keys (their key
    data in ``wanted``), with the implementation asked for; stored key data of another
    implementation is refused, data saved as plain arrays (`jax.random.key_data` by
    hand) is taken when its shape and dtype are the keys' data's."""
    problems = []
    names = {n for n, _ in wanted}
    for name, want in wanted:
        info = stored.get(name)
        if info is None:
            problems.append(f"{name}: not in the checkpoint")
            continue
        impl = impls.get(name)
        if info.prng_impl is not None and impl is not None and info.prng_impl != impl:
            problems.append(f"{name}: {impl} keys requested, {info.prng_impl} keys stored")
            continue
        shape = _shape_of(want)
        if shape is not None and tuple(shape) != info.shape:
            problems.append(f"{name}: shape {list(shape)} requested, {list(info.shape)} stored")
        dtype = _dtype_of(want)
        if dtype is not None and not cast and _name(dtype) not in (info.dtype, info.cast_from):
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


@functools.lru_cache(maxsize=256)
def _name(dtype: np.dtype[Any]) -> str:
    return dtype.name  # numpy builds it anew on every access (~2 us; thousands of leaves)


def _target(want: Any, info: LeafInfo, cast: bool) -> tuple[np.dtype[Any] | None, bool]:
    """The dtype to give a leaf in and whether to convert to it: ``want``'s (converted
    only with ``cast``), except that a leaf a save stored narrower (`LeafInfo.cast_from`)
    comes back in the dtype it had, unless its stored dtype is asked for."""
    dtype = _dtype_of(want)
    if info.cast_from is None:
        return dtype, cast
    if dtype is None:
        return dtype_of(info.cast_from), True
    return dtype, cast or _name(dtype) == info.cast_from


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex))


async def _materialize(
    read: Read, info: LeafInfo, want: Any, cast: bool, budget: ByteBudget | None
) -> Any:
    """The leaf in the form ``want`` asks for, from ``read`` (slices of the stored array).

    ``budget`` (None: the data is already in memory) bounds what is read ahead.
    """
    dtype, cast = _target(want, info, cast)
    sharding = getattr(want, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return await _read_sharded(read, info, sharding, dtype if cast else None, budget)
    if budget is not None:  # else already in memory
        check_fits(info.nbytes, "reading the leaf whole", leaf=info.name)
    async with _holding(budget, info.nbytes):
        whole = await read(())
    if cast and dtype is not None:
        whole = whole.astype(dtype)
    elif not whole.flags.writeable:  # a view of stored bytes: the caller gets its own array
        whole = whole.copy()
    if want is None:
        if info.python_type:
            return _PYTHON_TYPES[info.python_type](whole[()])
        return whole[()] if info.kind == "scalar" else whole
    if type(want) in _PYTHON_TYPES.values():  # exactly a Python number, not np.float64
        return type(want)(whole[()])
    return whole[()] if isinstance(want, np.generic) else whole


_PYTHON_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "complex": complex}


async def _read_sharded(
    read: Read,
    info: LeafInfo,
    sharding: jax.sharding.Sharding,
    dtype: np.dtype[Any] | None,
    budget: ByteBudget | None,
) -> jax.Array:
    """Read only the slices this process's devices hold, each distinct slice once, and
    hand each to its devices as soon as it is read. Where the reader can share chunks
    (`RawLeaf.expect`), a stored chunk that several slices overlap (a leaf restored onto
    another mesh) is read and checked once."""
    index_map = sharding.addressable_devices_indices_map(info.shape)
    devices_of: dict[tuple[tuple[int, int], ...], tuple[Index, list[Any]]] = {}
    for device, index in index_map.items():
        devices_of.setdefault(_key(index, info.shape), (tuple(index or ()), []))[1].append(device)
    itemsize = (dtype if dtype is not None else dtype_of(info.dtype)).itemsize

    # In the order of the stored chunks the slices start in, not of the devices: slices
    # that share a chunk then pass the budget together, and a shared chunk is not held
    # while unrelated slices are read (devices can come in any order on a mesh).
    def chunk_order(key: tuple[tuple[int, int], ...]) -> tuple[list[int], Any]:
        return [start // c for (start, _), c in zip(key, info.chunk_shape, strict=True)], key

    groups = [devices_of[key] for key in sorted(devices_of, key=chunk_order)]
    # Onto an accelerator a large slice goes in pieces (`_Pieces`): they are what is read.
    split = {
        k: pieces
        for k, (index, devices) in enumerate(groups)
        if not placement.on_host(devices)
        and (pieces := _Pieces.of(index, info, itemsize)) is not None
    }
    expect = getattr(read, "expect", None)
    if expect is not None:
        regions = [
            split[k].indices if k in split else [index] for k, (index, _) in enumerate(groups)
        ]
        expect([region for group in regions for region in group])

    async def place(k: int, index: Index, devices: list[Any]) -> list[jax.Array]:
        if k in split:
            return await split[k].place(read, devices, dtype or dtype_of(info.dtype), budget)
        nbytes = math.prod(_key_shape(_key(index, info.shape))) * itemsize
        check_fits(nbytes, "reading one device's slice", leaf=info.name)
        async with _holding(budget, nbytes):
            data = await read(index)
            if dtype is not None:
                data = data.astype(dtype)
            return await placement.put_slice(data, devices)

    placed = await settle(place(k, index, devices) for k, (index, devices) in enumerate(groups))
    on: dict[Any, jax.Array] = {}
    for (_, devices), arrays in zip(groups, placed, strict=True):
        on.update(zip(devices, arrays, strict=True))
    shards = [on[device] for device in index_map]
    return jax.make_array_from_single_device_arrays(info.shape, sharding, shards)


@dataclass(frozen=True)
class _Pieces:
    """A device slice larger than the host pool's buffers, read and placed piece by piece
    along one axis (`placement.piece_plan`, `placement.Assembly`), each piece within the
    budget: host memory holds pieces, never the whole slice."""

    shape: tuple[int, ...]
    axis: int
    rows: int
    indices: list[Index]  # each piece's region of the leaf
    starts: list[int]  # each piece's start in the slice along the axis

    @classmethod
    def of(cls, index: Index, info: LeafInfo, itemsize: int) -> _Pieces | None:
        key = _key(index, info.shape)
        shape = _key_shape(key)
        plan = placement.piece_plan(shape, itemsize, info.chunk_shape)
        if plan is None:
            return None
        axis, rows = plan
        starts = placement.piece_starts(shape[axis], rows)
        offset = key[axis][0]
        indices = [
            tuple(
                slice(offset + start, offset + start + rows) if a == axis else slice(lo, hi)
                for a, (lo, hi) in enumerate(key)
            )
            for start in starts
        ]
        return cls(shape, axis, rows, indices, starts)

    async def place(
        self, read: Read, devices: list[Any], dtype: np.dtype[Any], budget: ByteBudget | None
    ) -> list[jax.Array]:
        into = placement.Assembly(self.shape, dtype, self.axis, self.rows, devices)
        nbytes = math.prod(into.piece_shape) * dtype.itemsize

        async def one(start: int, index: Index) -> None:
            async with _holding(budget, nbytes):
                data = await read(index)
                await into.add(start, data if data.dtype == dtype else data.astype(dtype))

        await settle(one(s, i) for s, i in zip(self.starts, self.indices, strict=True))
        return into.arrays()


def _holding(budget: ByteBudget | None, nbytes: int) -> Any:
    return budget.hold(nbytes) if budget is not None else contextlib.nullcontext()


def _key_shape(key: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in key)


def _key(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (s.indices(d)[0], s.indices(d)[1]) for s, d in zip(tuple(index), shape, strict=True)
    )
