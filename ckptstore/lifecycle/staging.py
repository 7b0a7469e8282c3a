"""Staging: copy what a save needs from a training state into memory the save owns.

A training loop may donate, delete or overwrite its arrays as soon as `Stager.stage`
returns, so every piece a save will write is copied first. Three ways:

- "device": on accelerators with room for it, each `jax.Array` is copied on its own
  devices by a compiled program (`ckptstore.lifecycle.devicecopy`): the pause is that
  copy, at the device memory's speed. The save then moves each piece to the host as it
  writes it, and frees the piece on its device once its bytes are out (`DrainedPiece`),
  so host memory holds only what is being written.

- "host": of each `jax.Array`, the addressable shards with replica id 0 are copied to
  host memory (as `HostShards`). From an accelerator, every shard's transfer starts at
  once and the save keeps the host array each transfer made: JAX has no transfer into
  a caller's buffer, and copying that array once more into a reused one lengthened the
  pause past `jax.device_get`'s (docs/benchmarks.md, "On a TPU"). From CPU devices, the
  copy goes into buffers kept from one save to the next (same leaf, same shard shape and
  dtype), so a steady-state save touches no new pages; large copies run on a few threads
  (numpy releases the GIL while copying). The copy is done when `stage` returns. The way
  on CPU devices, and on accelerators without room for a device copy.
- "view" (asked for): where device memory is host memory (CPU devices), `stage` only
  takes zero-copy numpy views of the arrays' own buffers, and the save writes straight
  from them; the views are dropped when the save is done. While a view lives its buffer
  is never reused: a computation that donates it gets fresh memory instead, and
  `delete()` frees it only when the view is gone (tests/lifecycle/test_manager.py proves
  both with buffers whose memory is then handed out again). No copy at all, but no
  protection from a change made through another name for the same memory: on CPU devices
  `jax.device_put` of a numpy array may not copy, and a change to that numpy array before
  the save is done is what the step holds (tests/lifecycle/test_aliasing.py). Nothing in
  JAX tells such an array apart, so "auto" never picks "view".
  "auto" picks "host" where every array is on CPU devices, else "device" where every
  device holding the state has room for a copy of its shards (`devicecopy.device_room`),
  else "host". Which one a save used, and why, is in `Staged.mode` and `Staged.reason`
  (and the manager's `SaveStats`).

A typed PRNG key array is staged as its key data (`jax.random.key_data`, the same
buffers), its implementation recorded in `HostShards.prng_impl`.

Numpy arrays are always copied into reused host buffers; numbers are immutable. There is
never more than one staged copy of the state (the manager allows one save in flight).
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import jax
import numpy as np

from ckptstore.datapath.arrays import host_view
from ckptstore.errors import CkptStoreError, StagingBudgetError, TreeError
from ckptstore.format.leaves import HostShards, Index, is_key_array, key_impl_name
from ckptstore.format.tree import flatten
from ckptstore.lifecycle.devicecopy import (
    DeviceCopier,
    DrainedPiece,
    bytes_per_device,
    device_room,
)

Bounds = tuple[tuple[int, int], ...]

Mode = Literal["auto", "host", "view", "device"]

#: Touching one byte in each page of a new buffer faults the whole page in.
PAGE = 4096

#: `warm` touches new buffers in slices of this size on all staging threads: faulting
#: pages in is per-thread work (zeroing them), and one thread alone takes longer than the
#: steps between a loop's first declined step and its first save.
TOUCH_SLICE = 64 << 20

#: Copies smaller than this run inline; thread hand-off costs more than it saves.
THREAD_MIN_BYTES = 1 << 20


Copy = tuple[Any, np.ndarray[Any, Any] | None]  # (source, staging buffer or None: fetch)


@dataclass
class Staged:
    """A state staged for saving: the same tree with host memory in place of arrays
    (reused staging buffers, or in "view" mode zero-copy views of the arrays' buffers)."""

    tree: Any
    nbytes: int  # bytes the staged tree holds: staging buffers, views and device copies
    copied: int  # of which copied (into staging buffers, or on the devices)
    seconds: float  # how long `Stager.stage` took: the pause it caused
    mode: str = "host"  # how: "host", "view" or "device"
    reason: str = ""  # why that way, in words


class Stager:
    """Stages states into reused host buffers; one instance per manager."""

    def __init__(self, *, max_bytes: int | None = None, threads: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._buffers: dict[tuple[str, Bounds], np.ndarray[Any, Any]] = {}
        self._used: set[tuple[str, Bounds]] = set()  # buffers the current staging uses
        self._pool = ThreadPoolExecutor(
            max_workers=threads or min(8, os.cpu_count() or 1), thread_name_prefix="ckpt-stage"
        )
        self._copier = DeviceCopier()
        self._on_devices: dict[Any, int] = {}  # bytes per device of the last device copy
        self._warming: list[Future[None]] = []  # `warm` making the host buffers

    @property
    def held_bytes(self) -> int:
        """Host memory held in staging buffers."""
        return sum(b.nbytes for b in self._buffers.values())

    def close(self) -> None:
        self._warming = []
        self._pool.shutdown(wait=True)
        self._copier.close()
        self._buffers.clear()

    def warm(self, tree: Any, mode: Mode = "auto") -> None:
        """Prepare, in the background, what staging ``tree`` will run, so that the first
        save pauses no longer than later ones (the manager calls this on the steps it does
        not save): where it will stage on the devices, the copy's programs are compiled;
        where on the host, its buffers are made and their pages touched (fresh pages cost
        more than the copy into them). An accelerator's arrays have no buffers: each
        transfer brings its own host memory. `stage` waits for what is left."""
        leaves = jax.tree_util.tree_leaves(tree)
        arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
        if not arrays or self._warming:
            return
        chosen, _ = self._choose(mode, arrays)
        if chosen == "device":
            self._copier.warm([_data(a) for a in arrays])
        elif chosen == "host":
            size = sum(
                int(leaf.nbytes) for leaf in leaves if isinstance(leaf, jax.Array | np.ndarray)
            )
            if self.max_bytes is None or size <= self.max_bytes:  # else `stage` refuses it
                # The buffers are planned here, from the arrays as they are now (the loop
                # may donate them next); making them costs no page yet, touching does.
                try:
                    names = [name for name, _ in flatten(tree)]
                except TreeError:  # not on a step it does not save: `stage` will say it
                    return
                bufs = [
                    buf
                    for name, leaf in zip(names, leaves, strict=True)
                    for _, buf in self._plan(name, leaf, False, False)[1]
                    if buf is not None  # a device array's shard: fetched, no buffer
                ]
                self._warming = [self._pool.submit(_touch, part) for part in _slices(bufs)]

    def _warmed(self) -> None:
        """Wait for `warm`'s buffers, if it is making them (raising what it raised)."""
        warming, self._warming = self._warming, []
        for future in warming:
            future.result()

    def stage(
        self, tree: Any, mode: Mode = "auto", *, host_view: bool = False, drain: bool = True
    ) -> Staged:
        """Copy every piece of ``tree`` a save writes (see the module docstring for ``mode``).

        ``drain`` (device staging): each piece is freed on its device when the save moves
        it to the host, so the save may read each piece once only; false where a save may
        read its pieces twice (an incremental save digests them before writing).

        ``host_view``: also the addressable slices held as replicas whose replica 0 is on
        another process (`HostShards.extra`), which a save on a host-local fast tier writes
        so that the host can serve a restart alone (`ckptstore.tiers.hostlocal`).
        Must not run while an earlier staged tree is still being written (the buffers
        are reused): the manager allows one save in flight.
        """
        start = time.perf_counter()
        self._warmed()
        names = [name for name, _ in flatten(tree)]  # checks the tree whole first
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise CkptStoreError(f"leaf {name!r} was deleted (donated?) before staging")
        arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
        chosen, reason = self._choose(mode, arrays)
        views = chosen == "view"
        self._used = set()
        if chosen == "device":
            return self._on_device(names, leaves, treedef, host_view, drain, reason, start)
        plan = [
            self._plan(n, leaf, views, host_view) for n, leaf in zip(names, leaves, strict=True)
        ]
        copies = [c for _, cs, _ in plan for c in cs]
        copied = sum(int(src.nbytes) for src, _ in copies)
        needed = copied + sum(v.nbytes for _, _, views in plan for v in views)
        self._check_budget(needed)
        for key in set(self._buffers) - self._used:
            del self._buffers[key]  # shards no longer in the state (or resharded)
        fetched = self._run(copies)
        values = [_with_fetched(value, fetched) for value, _, _ in plan]
        return Staged(
            tree=jax.tree_util.tree_unflatten(treedef, values),
            nbytes=needed,
            copied=copied,
            seconds=time.perf_counter() - start,
            mode=chosen,
            reason=reason,
        )

    def _check_budget(self, needed: int) -> None:
        if self.max_bytes is not None and needed > self.max_bytes:
            raise StagingBudgetError(
                f"staging this state needs {needed} bytes of host memory; "
                f"the manager may use {self.max_bytes} (options.max_staging_bytes)"
            )

    def _choose(self, mode: Mode, arrays: list[jax.Array]) -> tuple[str, str]:
        """The way to stage ``arrays`` asked for as ``mode``, and why."""
        if mode in ("host", "view"):
            return mode, "asked for"
        if mode == "auto" and all(_on_cpu(a) for a in arrays):
            # Not "view": such an array may be a numpy buffer the caller changes next.
            return "host", "every array is in host memory (CPU devices), maybe shared"
        room, why = device_room([_data(a) for a in arrays], self._on_devices)
        if room or (room is None and mode == "device"):
            return "device", why if mode == "auto" else "asked for"
        return "host", why

    def _on_device(
        self,
        names: list[str],
        leaves: list[Any],
        treedef: Any,
        extra: bool,
        drain: bool,
        reason: str,
        start: float,
    ) -> Staged:
        """Stage on the devices: every `jax.Array` copied there at once, numpy arrays
        into reused host buffers."""
        plan = [
            self._plan(n, leaf, False, False) if _host(leaf) else (leaf, [], [])
            for n, leaf in zip(names, leaves, strict=True)
        ]
        copies_on_host = [c for _, cs, _ in plan for c in cs]
        host_bytes = sum(src.nbytes for src, _ in copies_on_host)  # numpy leaves only
        self._check_budget(host_bytes)
        for key in set(self._buffers) - self._used:
            del self._buffers[key]
        self._run(copies_on_host)
        positions = [k for k, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
        sources = [_data(leaves[k]) for k in positions]
        self._on_devices = bytes_per_device(sources)
        values = [value for value, _, _ in plan]
        on_devices = sum(int(a.nbytes) for a in sources)
        # The copies themselves are dropped here: their pieces hold what the save writes.
        for k, copy in zip(positions, self._copier.copy(sources), strict=True):
            values[k] = _device_shards(copy, leaves[k], extra, drain)
        return Staged(
            tree=jax.tree_util.tree_unflatten(treedef, values),
            nbytes=host_bytes + on_devices,
            copied=host_bytes + on_devices,
            seconds=time.perf_counter() - start,
            mode="device",
            reason=reason,
        )

    def _run(self, copies: list[Copy]) -> dict[int, np.ndarray[Any, Any]]:
        """Make ``copies``: into their buffers, or (no buffer: a device array) fetched as
        the transfer's own host array, returned by the source's id."""
        if any(not _on_cpu(src) for src, _ in copies):  # overlap device-to-host transfers
            for src, _ in copies:
                if isinstance(src, jax.Array):
                    src.copy_to_host_async()
        into = [(src, dst) for src, dst in copies if dst is not None]
        for src, dst in into:
            if dst.nbytes < THREAD_MIN_BYTES:
                _copy(src, dst)
        list(
            self._pool.map(
                lambda c: _copy(*c), [c for c in into if c[1].nbytes >= THREAD_MIN_BYTES]
            )
        )
        fetch = [src for src, dst in copies if dst is None]
        return {
            id(src): got for src, got in zip(fetch, self._pool.map(np.asarray, fetch), strict=True)
        }

    def _plan(
        self, name: str, leaf: Any, views: bool, extra: bool
    ) -> tuple[Any, list[Copy], list[np.ndarray[Any, Any]]]:
        """The staged stand-in for ``leaf``, the copies that fill it and the views it holds."""
        if isinstance(leaf, jax.Array):
            impl = None
            if is_key_array(leaf):  # a typed PRNG key array: its key data is what is saved
                impl = key_impl_name(leaf.dtype)
                leaf = jax.random.key_data(leaf)
            now: list[Copy] = []
            held: list[np.ndarray[Any, Any]] = []

            def stage(shards: list[Any]) -> tuple[tuple[Index, np.ndarray[Any, Any]], ...]:
                pieces: list[tuple[Index, np.ndarray[Any, Any]]] = []
                for shard in shards:
                    index, data = tuple(shard.index), shard.data
                    view = host_view(data) if views else None
                    if view is not None:  # the device buffer itself, held until the save is done
                        pieces.append((index, view))
                        held.append(view)
                        continue
                    if not _on_cpu(data):  # fetched by `_run`: the transfer's own host copy
                        pieces.append((index, data))
                        now.append((data, None))
                        continue
                    key = (name, _key(index, leaf.shape))
                    buf = self._buffer(key, data.shape, leaf.dtype)
                    pieces.append((index, buf))
                    now.append((data, buf))
                return tuple(pieces)

            own = [s for s in leaf.addressable_shards if s.replica_id == 0]
            value = HostShards(
                tuple(leaf.shape),
                np.dtype(leaf.dtype),
                leaf.sharding,
                stage(own),
                stage(_other_replicas(leaf, own)) if extra else None,
                prng_impl=impl,
            )
            return value, now, held
        if isinstance(leaf, np.ndarray):
            buf = self._buffer((name, ()), leaf.shape, leaf.dtype)
            return buf, [(leaf, buf)], []
        return leaf, [], []  # numpy scalars and Python numbers are immutable

    def _buffer(
        self, key: tuple[str, Bounds], shape: tuple[int, ...], dtype: Any
    ) -> np.ndarray[Any, Any]:
        self._used.add(key)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != np.dtype(dtype):
            buf = self._buffers[key] = np.empty(shape, dtype)
        return buf


def _slices(bufs: list[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
    """``bufs`` as flat byte views of at most `TOUCH_SLICE` bytes each."""
    flat = [buf.reshape(-1).view(np.uint8) for buf in bufs if buf.nbytes]
    return [b[k : k + TOUCH_SLICE] for b in flat for k in range(0, b.nbytes, TOUCH_SLICE)]


def _with_fetched(value: Any, fetched: dict[int, np.ndarray[Any, Any]]) -> Any:
    """``value`` (a staged leaf) with the pieces `Stager._run` fetched in place of their
    device arrays."""
    if not fetched or not isinstance(value, HostShards):
        return value

    def swap(pieces: tuple[tuple[Index, Any], ...]) -> tuple[tuple[Index, Any], ...]:
        return tuple((index, fetched.get(id(piece), piece)) for index, piece in pieces)

    extra = None if value.extra is None else swap(value.extra)
    return dataclasses.replace(value, pieces=swap(value.pieces), extra=extra)


def _touch(part: np.ndarray[Any, Any]) -> None:
    """Fault in every page of ``part`` (a slice of a new staging buffer)."""
    part[::PAGE] = 0


def _data(leaf: jax.Array) -> jax.Array:
    """What staging copies of ``leaf``: a typed PRNG key array's key data, else itself."""
    return jax.random.key_data(leaf) if is_key_array(leaf) else leaf


def _host(leaf: Any) -> bool:
    return not isinstance(leaf, jax.Array)


def _device_shards(copy: jax.Array, leaf: jax.Array, extra: bool, drain: bool) -> HostShards:
    """``copy`` (of ``leaf``, made by staging) as the pieces a save writes; the copy's
    other replicas are freed at once, unless a host-local tier's ``extra`` needs them."""
    own = [s for s in copy.addressable_shards if s.replica_id == 0]
    others = _other_replicas(copy, own) if extra else []

    def pieces(shards: list[Any]) -> tuple[tuple[Index, Any], ...]:
        return tuple((tuple(s.index), DrainedPiece(s.data) if drain else s.data) for s in shards)

    # The pieces hold their own buffers: the copy's other replicas go with the copy.
    return HostShards(
        tuple(copy.shape),
        np.dtype(copy.dtype),
        copy.sharding,
        pieces(own),
        pieces(others) if extra else None,
        prng_impl=key_impl_name(leaf.dtype) if is_key_array(leaf) else None,
    )


def _other_replicas(leaf: jax.Array, own: list[Any]) -> list[Any]:
    """One addressable shard per region this process holds but does not write (its
    replica 0 is on another process): `ckptstore.datapath.arrays.host_view_slices`, staged."""
    have = {_key(tuple(s.index), leaf.shape) for s in own}
    out = []
    for shard in leaf.addressable_shards:
        key = _key(tuple(shard.index), leaf.shape)
        if key not in have:
            have.add(key)
            out.append(shard)
    return out


def _on_cpu(src: Any) -> bool:
    return not isinstance(src, jax.Array) or all(d.platform == "cpu" for d in src.devices())


def _copy(src: Any, dst: np.ndarray[Any, Any]) -> None:
    np.copyto(dst, np.asarray(src), casting="no")


def _key(index: Index, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A hashable form of a shard index: (start, stop) per dimension."""
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
