"""Save/restore benchmark: ckptstore vs ``dd`` and Orbax, side by side, on four trees.

Trees (``benchmarks/trees.py``): ``a`` 1 GiB, 4 large sharded leaves + 300 small;
``b`` 434 MiB, 4 x 96 MiB sharded + 200 x 256 KiB; ``c`` 5,000 leaves of 16 KiB
to 1 MiB; ``d`` 2 huge leaves restored onto another mesh. On 8 CPU devices, random
data. Per tree, in phases, each interleaved (the first contender rotates every
repetition), medians with their spread:

- save: ``await ckptstore.save(path, tree, step=N)`` (durable: fsyncs) vs ``dd
  bs=16M oflag=direct conv=fsync`` of as many bytes, and vs Orbax
  ``StandardCheckpointer().save`` + ``wait_until_finished()`` as is and followed
  by an fsync of every file and directory (equal durability), and vs Orbax with its
  compression off, + fsync (Orbax's default compresses every chunk with zstd level 1;
  ckptstore writes raw bytes; ``AsyncCheckpointer(PyTreeCheckpointHandler(
  use_compression=False))``, the handler ``StandardCheckpointer``'s wraps, with
  ``args.PyTreeSave``);
- restore onto the requested shardings: ``ckptstore.restore(like=...)`` vs Orbax
  ``restore(target=...)`` of its default checkpoint and of its uncompressed one, cold
  (every file's pages evicted first with
  ``POSIX_FADV_DONTNEED``; dropping the whole page cache needs root) and warm, and
  cold vs a raw read of as many bytes (``dd bs=16M`` of one evicted file), vs reading
  the checkpoint's own files (evicted, one after another, 16 MiB reads: the same bytes),
  and (for information, in a phase of their own) vs the raw read and the reading of its
  files into new memory (buffers kept until the read ends), as a restore must read;
- what a restore or read returns is freed after its timer stops, for every contender: a
  job keeps what it restored, and freeing 5,000 restored jax arrays (tree c) took ~0.13 s
  against ~0.02 s for the same bytes in 16 MiB buffers (runs of 2026-12-05);
- every timed operation starts from recently freed memory (`common.recycle_memory`):
  on this VM the host takes freed memory back within about a second, and touching it
  again costs several times as much; one phase of its own (for information) waits for
  that first, the restore against the raw read into new memory;
- on the first tree: peak resident memory a save and a restore add (VmHWM over the RSS
  once the tree is built, each in a fresh subprocess), those restores' times (each the
  first of its process, files evicted: a restarted job's restore) vs Orbax's, and the
  merge of 64 per-process OCDBT stores vs the bare TensorStore transaction.

Floors: save >= 0.9x dd on ``a`` and ``d``, >= 0.8x on ``b``, >= 0.6x on ``c``, both
in one process (after a warm-up save) and as the first save of fresh processes (each
builds the tree, then saves once: a job's first checkpoint); save >= 1.5x faster than
Orbax at equal durability; restore >= 1.5x Orbax cold, warm and as a fresh process's
first; cold >= 0.8x the raw read and >= 0.9x reading its files into new memory; peak
memory <= 0.25x the state; merge <= 1.5x the bare transaction.

    python benchmarks/save_restore.py                 # all trees, 5 reps
    python benchmarks/save_restore.py --trees a,c     # some trees
    python benchmarks/save_restore.py --quick         # 1/16 size, 1 rep (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

# 8 CPU devices for the (4, 2) mesh; must be set before jax initializes (the last flag wins).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
import tensorstore as ts

import ckptstore
from benchmarks import common, trees
from benchmarks.common import MiB, Timer
from benchmarks.trees import TREES
from ckptstore.backends.local import LocalBackend
from ckptstore.checkpoint.merge import merge
from ckptstore.datapath.arrays import write_leaves
from ckptstore.datapath.stores import MAX_INFLIGHT_BYTES, ocdbt_spec
from ckptstore.format.leaves import describe_leaf
from ckptstore.runtime.hostpool import aligned_empty

PACKAGES = ["ckptstore", "jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint", "psutil"]
# Each phase interleaves its contenders side by side. The disk comparison runs apart from
# Orbax: Orbax allocates and frees over 1 GiB per save, and on this VM freshly reported free
# pages make the next page-cache writes erratically slow. For the same reason the reads into
# new memory (each fills and frees as much as the state) run apart from the raw reads.
PHASES = {
    "disk": ["ckpt_save", "dd_direct"],
    "disk_first": ["ckpt_save_first", "dd_direct"],
    "orbax": ["ckpt_save", "orbax_save_fsync", "orbax_save", "orbax_raw_save_fsync"],
    "cold": ["ckpt_restore", "raw_read", "raw_read_files"],
    "cold_fresh": ["ckpt_restore", "raw_read_fresh", "raw_read_files_fresh"],
    "cold_reclaimed": ["ckpt_restore_reclaimed", "raw_read_fresh_reclaimed"],
    "cold_orbax": ["ckpt_restore", "orbax_restore", "orbax_raw_restore"],
    "warm": ["ckpt_restore_warm", "orbax_restore_warm", "orbax_raw_restore_warm"],
}
ORBAX_PHASES = {"orbax", "cold_orbax", "warm"}
#: Orbax needs minutes per save of tree c's 5,000 leaves here (one took 11 min under load),
#: so c's comparisons with Orbax run on c at this fraction of its size; its dd and raw-read
#: comparisons use the whole tree.
ORBAX_SCALE = {"c": 0.2}
SAVE_VS_DD = {"a": 0.9, "b": 0.8, "c": 0.6, "d": 0.9}  # floors per tree
# (label, phase, ckptstore's timing, baseline's timing, floor on baseline/ckptstore or None;
# "dd" stands for the tree's SAVE_VS_DD floor)
TIME_ROWS: list[tuple[str, str, str, str, float | str | None]] = [
    ("save (fsync) vs dd direct+fsync", "disk", "ckpt_save", "dd_direct", "dd"),
    (
        "first save of a fresh process (fsync) vs dd direct+fsync",
        "disk_first",
        "ckpt_save_first",
        "dd_direct",
        "dd",
    ),
    ("save (fsync) vs Orbax + fsync", "orbax", "ckpt_save", "orbax_save_fsync", 1.5),
    ("save (fsync) vs Orbax as is", "orbax", "ckpt_save", "orbax_save", None),
    (
        "save (fsync) vs Orbax uncompressed + fsync",
        "orbax",
        "ckpt_save",
        "orbax_raw_save_fsync",
        None,
    ),
    ("restore (cold) vs Orbax", "cold_orbax", "ckpt_restore", "orbax_restore", 1.5),
    (
        "restore (cold) vs Orbax uncompressed",
        "cold_orbax",
        "ckpt_restore",
        "orbax_raw_restore",
        None,
    ),
    ("restore (cold) vs raw read", "cold", "ckpt_restore", "raw_read", 0.8),
    ("restore (cold) vs reading its files", "cold", "ckpt_restore", "raw_read_files", 0.8),
    (
        "restore (cold) vs raw read into new memory",
        "cold_fresh",
        "ckpt_restore",
        "raw_read_fresh",
        None,
    ),
    (
        "restore (cold) vs reading its files into new memory",
        "cold_fresh",
        "ckpt_restore",
        "raw_read_files_fresh",
        0.9,
    ),
    (
        "restore (cold) vs raw read into new memory, freed memory reclaimed by the host",
        "cold_reclaimed",
        "ckpt_restore_reclaimed",
        "raw_read_fresh_reclaimed",
        None,
    ),
    ("restore (warm) vs Orbax", "warm", "ckpt_restore_warm", "orbax_restore_warm", 1.5),
    (
        "restore (warm) vs Orbax uncompressed",
        "warm",
        "ckpt_restore_warm",
        "orbax_raw_restore_warm",
        None,
    ),
]
MEMORY_FLOOR = 0.25  # peak added / state bytes
RESTORE_INFLIGHT = MAX_INFLIGHT_BYTES  # the restore's read-ahead budget
MERGE_FLOOR = 1.5  # ckptstore time / bare time


# ---- workload ---------------------------------------------------------------------------


def tree_bytes(tree: Any) -> int:
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree))


# ---- files ----------------------------------------------------------------------------------


def files_below(path: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(path) for f in fs]


def du(path: Path) -> int:
    """Sum of the sizes of the files below ``path``."""
    return sum(p.stat().st_size for p in files_below(path))


def _with_fd(path: Path | str, op: Callable[[int], object]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        op(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory below ``path``, and ``path``'s parent."""
    for d, _, fs in os.walk(path):
        for name in [*fs, "."]:
            _with_fd(os.path.join(d, name), os.fsync)
    _with_fd(path.parent, os.fsync)


def evict_tree(path: Path) -> None:
    """Drop the pages of every file below ``path`` from the page cache (after a sync)."""
    os.sync()
    for p in [path] if path.is_file() else files_below(path):
        _with_fd(p, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def read_fresh(files: Sequence[Path]) -> list[np.ndarray[Any, Any]]:
    """Read ``files`` one after another in 16 MiB reads, each into a new buffer allocated as
    a restore allocates them (`aligned_empty`); returns the buffers (what was read, as a
    restore returns its tree: freed by the caller once its timer has stopped)."""
    kept = []
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while True:
                buf = aligned_empty((16 * MiB,), np.dtype(np.uint8))
                if not f.readinto(buf.data):
                    break
                kept.append(buf)
    return kept


def orbax_save(tree: Any, path: Path, fsync: bool = False, compress: bool = True) -> None:
    """Orbax's `StandardCheckpointer` save, finished; then optionally fsync everything.
    ``compress=False``: the same save with compression off (the handler it wraps,
    `PyTreeCheckpointHandler`, with ``use_compression=False``: `StandardCheckpointHandler`
    takes no such option)."""
    import orbax.checkpoint as ocp

    if compress:
        ckptr: Any = ocp.StandardCheckpointer()
    else:
        ckptr = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    try:
        if compress:
            ckptr.save(path, tree)
        else:
            ckptr.save(path, args=ocp.args.PyTreeSave(tree))
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    if fsync:
        fsync_tree(path)


def orbax_manager(root: Path, compress: bool = True) -> Any:
    """Orbax's async `CheckpointManager` keeping one step; ``compress=False``: its
    `PyTreeCheckpointHandler` with ``use_compression=False`` in the handler registry, for
    ``args.PyTreeSave`` (`StandardCheckpointHandler` takes no such option)."""
    import orbax.checkpoint as ocp

    registry: dict[str, Any] = {}
    if not compress:
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
        handlers.add(None, ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler(use_compression=False))
        registry["handler_registry"] = handlers
    options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
    return ocp.CheckpointManager(root, options=options, **registry)


def orbax_compressor(path: Path) -> Any:
    """The zarr compressor Orbax wrote for the first leaf of the checkpoint at ``path``."""
    leaves = json.loads((path / "_METADATA").read_text())["tree_metadata"].values()
    first = next(v for v in leaves if v["value_metadata"]["value_type"] == "jax.Array")
    key = ".".join(str(k["key"]) for k in first["key_metadata"])
    kvstore = {"driver": "ocdbt", "base": f"file://{path}", "path": key}
    array = ts.open({"driver": "zarr", "kvstore": kvstore}).result()
    return array.spec().to_json()["metadata"].get("compressor")


def orbax_restore(path: Path, abstract: Any) -> Any:
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    try:
        return jax.block_until_ready(ckptr.restore(path, target=abstract))
    finally:
        ckptr.close()


# ---- the contenders -------------------------------------------------------------------------


class Contenders:
    """Timed operations on one tree; each returns seconds. Saves go to fresh directories."""

    def __init__(
        self, tree: Any, abstract: Any, scratch: Path, nbytes: int, reclaim_wait: float
    ) -> None:
        self.tree, self.abstract, self.scratch = tree, abstract, scratch
        self.nbytes, self.reclaim_wait = nbytes, reclaim_wait
        #: Runs a fresh process that builds the tree and saves it once: that save's seconds.
        self.first_save: Callable[[Path], float] | None = None
        self.count = 0
        self.src = scratch / "dd_source.bin"  # as many random bytes, cached
        with open(self.src, "wb") as f:
            rng = np.random.default_rng(1)
            for off in range(0, nbytes, 64 * MiB):
                f.write(rng.bytes(min(64 * MiB, nbytes - off)))

    def fresh(self, name: str) -> Path:
        self.count += 1
        return self.scratch / f"{name}_{self.count}"

    def timed(self, reclaimed: bool = False) -> Timer:
        """The timer of an operation, started right after the last step of its set-up: twice
        the state's bytes of recently freed memory (as much as a cold restore's result and
        page cache need) or, ``reclaimed``, a pause long enough for the host to take freed
        memory back."""
        if reclaimed:
            time.sleep(self.reclaim_wait)
        else:
            common.recycle_memory(2 * self.nbytes)
        return Timer()

    def _dd(self, *flags: str) -> float:
        dst = self.fresh("dd")
        with self.timed() as t:
            cmd = ["dd", f"if={self.src}", f"of={dst}", "bs=16M", *flags, "status=none"]
            subprocess.run(cmd, check=True)
        dst.unlink()
        return t.seconds

    async def dd_direct(self) -> float:
        return self._dd("oflag=direct", "conv=fsync")

    async def raw_read(self) -> float:
        """Read as many bytes as the tree holds from an evicted file (the restores' floor)."""
        evict_tree(self.src)
        with self.timed() as t:
            cmd = ["dd", f"if={self.src}", "of=/dev/null", "bs=16M", "status=none"]
            subprocess.run(cmd, check=True)
        return t.seconds

    async def raw_read_fresh(self, reclaimed: bool = False) -> float:
        """`raw_read` into new memory, as a restore must read: 16 MiB buffers allocated as a
        restore allocates them (`aligned_empty`), all kept until the read ends."""
        evict_tree(self.src)
        with self.timed(reclaimed) as t:
            got = read_fresh([self.src])
        del got  # after the timer, as every read and restore here
        return t.seconds

    async def raw_read_fresh_reclaimed(self) -> float:
        return await self.raw_read_fresh(reclaimed=True)

    async def raw_read_files(self) -> float:
        """Read the restored checkpoint's own files (the same bytes a restore reads, in the
        same files), evicted, one after another in 16 MiB reads into one buffer."""
        path = self.scratch / "restore_ckpt"
        evict_tree(path)
        buf = bytearray(16 * MiB)
        with self.timed() as t:
            for file in files_below(path):
                with open(file, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
        return t.seconds

    async def raw_read_files_fresh(self) -> float:
        """`raw_read_files` into new memory kept until the end (`raw_read_fresh`'s way): the
        least a restore must do, with no checksum, assembly or device hand-off."""
        path = self.scratch / "restore_ckpt"
        evict_tree(path)
        with self.timed() as t:
            got = read_fresh(files_below(path))
        del got  # after the timer, as every read and restore here
        return t.seconds

    async def ckpt_save(self, keep: Path | None = None) -> float:
        path = keep or self.fresh("ckpt")
        with self.timed() as t:
            await ckptstore.save(str(path), self.tree, step=self.count)
        if keep is None:
            shutil.rmtree(path)
        return t.seconds

    async def ckpt_save_first(self) -> float:
        """A save that is its process's first (module imported, tree built: a job's first
        checkpoint), in a fresh subprocess; the tree is built the same way each time."""
        assert self.first_save is not None
        return self.first_save(self.fresh("first"))

    async def orbax_save(
        self, fsync: bool = False, keep: Path | None = None, compress: bool = True
    ) -> float:
        path = keep or self.fresh("orbax")
        with self.timed() as t:  # Orbax runs its own event loop: keep it off ours
            await asyncio.to_thread(orbax_save, self.tree, path, fsync, compress)
        if keep is None:
            shutil.rmtree(path)
        return t.seconds

    async def orbax_save_fsync(self) -> float:
        return await self.orbax_save(fsync=True)

    async def orbax_raw_save_fsync(self) -> float:
        return await self.orbax_save(fsync=True, compress=False)

    async def ckpt_restore(self, cold: bool = True, reclaimed: bool = False) -> float:
        path = self.scratch / "restore_ckpt"
        if cold:
            evict_tree(path)
        with self.timed(reclaimed) as t:
            got = jax.block_until_ready(await ckptstore.restore(str(path), like=self.abstract))
        del got  # freeing what a restore returns is not part of it (see the module docstring)
        return t.seconds

    async def ckpt_restore_warm(self) -> float:
        return await self.ckpt_restore(cold=False)

    async def ckpt_restore_reclaimed(self) -> float:
        return await self.ckpt_restore(reclaimed=True)

    async def orbax_restore(self, cold: bool = True, where: str = "restore_orbax") -> float:
        if cold:
            evict_tree(self.scratch / where)
        with self.timed() as t:
            got = await asyncio.to_thread(orbax_restore, self.scratch / where, self.abstract)
        del got  # after the timer, as ours
        return t.seconds

    async def orbax_restore_warm(self) -> float:
        return await self.orbax_restore(cold=False)

    async def orbax_raw_restore(self) -> float:
        """Orbax's restore (the same call) of the checkpoint it saved uncompressed."""
        return await self.orbax_restore(where="restore_orbax_raw")

    async def orbax_raw_restore_warm(self) -> float:
        return await self.orbax_restore(cold=False, where="restore_orbax_raw")


def check_restores(c: Contenders, with_orbax: bool = True) -> None:
    """Both tools give back the saved values with the requested shardings."""
    got_ck = asyncio.run(ckptstore.restore(str(c.scratch / "restore_ckpt"), like=c.abstract))
    want = jax.tree_util.tree_leaves(c.tree)
    shardings = [a.sharding for a in jax.tree_util.tree_leaves(c.abstract)]
    checks = [("ckptstore", got_ck)]
    if with_orbax:
        checks.append(("orbax", orbax_restore(c.scratch / "restore_orbax", c.abstract)))
        raw = c.scratch / "restore_orbax_raw"
        checks.append(("orbax uncompressed", orbax_restore(raw, c.abstract)))
    for name, got in checks:
        for a, b, s in zip(want, jax.tree_util.tree_leaves(got), shardings, strict=True):
            if b.sharding != s or not np.array_equal(np.asarray(a), np.asarray(b)):
                raise AssertionError(f"{name} restored something else than it saved")


# ---- peak memory (fresh processes) ----------------------------------------------------------


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child_memory(
    tool: str, path: Path, tree_name: str, scale: float, seed: int
) -> dict[str, float]:
    """Save the tree once (tools ``ckptstore``, ``orbax``) or restore the checkpoint at
    ``path`` (``*-restore``); the resident memory that added at its peak, and its time."""
    restoring = tool.endswith("-restore")
    if restoring:
        tree, abstract = None, trees.abstract(tree_name, scale, seed)
    else:
        tree, abstract = TREES[tree_name](scale, seed)
    baseline = _status_bytes("VmRSS")
    samples, stop = [baseline], threading.Event()

    def sample() -> None:  # a cross-check of VmHWM, and the fallback if it cannot be reset
        while not stop.wait(0.005):
            samples.append(_status_bytes("VmRSS"))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        hwm = True
    except OSError:
        hwm = False
    # Each library's modules are imported before the timer, as a training script imports
    # them at its start: the timed call is the process's first save or restore, not its
    # first import.
    save, restore_sync = ckptstore.save, ckptstore.restore_sync
    if tool.startswith("orbax"):
        import orbax.checkpoint  # noqa: F401
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with Timer() as t:
        if tool == "ckptstore":
            asyncio.run(save(str(path), tree, step=1))
        elif tool == "orbax":
            orbax_save(tree, path)
        elif tool == "ckptstore-restore":  # not asyncio.run: see the README on Python 3.11
            got = jax.block_until_ready(restore_sync(str(path), like=abstract))
        else:
            got = orbax_restore(path, abstract)
    stop.set()
    sampler.join()
    peak = max(_status_bytes("VmHWM") if hwm else 0, *samples)
    out: dict[str, float] = {"baseline_rss": baseline, "peak_added": peak - baseline}
    out["seconds"] = t.seconds  # a restore: the process's first, of evicted files
    if restoring:
        out["restored_bytes"] = tree_bytes(got)
        out["largest_shard"] = max(
            int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
            for a in jax.tree_util.tree_leaves(got)
        )
    return out


def measure_memory(
    tool: str, path: Path, tree: str, scale: float, args: argparse.Namespace
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child-memory", tool, "--child-path", str(path)]
    cmd += ["--child-tree", tree, "--scale", str(scale)]
    out = subprocess.run([*cmd, "--seed", str(args.seed)], check=True, capture_output=True)
    if not tool.endswith("-restore"):
        shutil.rmtree(path, ignore_errors=True)
    got: dict[str, float] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return got


# ---- merge ------------------------------------------------------------------------------------


async def write_stores(root: Path, stores: int, store_bytes: int) -> tuple[list[str], list[Any]]:
    """``stores`` per-process OCDBT stores below ``root/item``, each with 4 leaves of its own."""
    backend = LocalBackend(root)
    children, infos = [], []
    rng = np.random.default_rng(2)
    for p in range(stores):
        values = [rng.random(store_bytes // 16, dtype=np.float32) for _ in range(4)]
        leaves = [(describe_leaf(f"p{p}.w{j}", v), v) for j, v in enumerate(values)]
        child = f"item/ocdbt.process_{p}"
        spec = ocdbt_spec(backend.kvstore_spec(child))
        await write_leaves(spec, backend.ts_context, leaves, process=0, write_metadata=True)
        children.append(child)
        infos += [info for info, _ in leaves]
    return children, infos


async def bare_merge(backend: LocalBackend, parent: str, children: list[str]) -> None:
    """The bare TensorStore transaction: copy every child into the parent, commit once."""
    ctx = backend.ts_context
    parent_kv = await ts.KvStore.open(ocdbt_spec(backend.kvstore_spec(parent)), context=ctx)
    txn = ts.Transaction(atomic=True)
    view = parent_kv.with_transaction(txn)
    for child in children:
        child_kv = await ts.KvStore.open(ocdbt_spec(backend.kvstore_spec(child)), context=ctx)
        await child_kv.experimental_copy_range_to(view)
    await txn.commit_async()


async def bench_merge(scratch: Path, reps: int, stores: int, store_bytes: int) -> dict[str, Any]:
    added: dict[str, list[int]] = {"ckptstore": [], "bare": []}
    count = iter(range(1 << 30))

    def runner(tool: str) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            root = scratch / f"merge_{tool}_{next(count)}"
            children, infos = await write_stores(root, stores, store_bytes)
            backend = LocalBackend(root)
            before = du(root)
            with Timer() as t:
                if tool == "ckptstore":  # validation of the merged view included
                    await merge(backend, "item", children, infos)
                else:
                    await bare_merge(backend, "item", children)
            added[tool].append(du(root) - before)
            shutil.rmtree(root)
            return t.seconds

        return run

    ck, bare = await common.interleave(reps, [runner("ckptstore"), runner("bare")])
    return {"ckptstore": ck, "bare": bare, "bytes_added": added}


# ---- the run ----------------------------------------------------------------------------------


def run_tree(
    name: str, args: argparse.Namespace, scratch: Path, memory: bool = False
) -> dict[str, Any]:
    """Every phase on one tree: its timings keyed ``phase:contender``, the size each phase
    ran on, and with ``memory`` the peak memory that saves and restores add."""
    out: dict[str, Any] = {"timings": {}, "sizes": {}, "memory": {}}
    orbax_scale = ORBAX_SCALE.get(name)
    chosen = [p for p in PHASES if p in args.phases]
    if orbax_scale is None:
        passes = [(args.scale, chosen)]
    else:
        passes = [
            (args.scale, [p for p in chosen if p not in ORBAX_PHASES]),
            (args.scale * orbax_scale, [p for p in chosen if p in ORBAX_PHASES]),
        ]
    passes = [(scale, phases) for scale, phases in passes if phases]
    for scale, phases in passes:
        with_orbax = any(p in ORBAX_PHASES for p in phases)
        _run_pass(name, scale, phases, with_orbax, args, scratch, out)
        if memory and with_orbax:
            out["memory"] = _peaks(name, scale, args, scratch)
        for leftover in scratch.iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        common.release_memory()
    first = passes[0][1][0]
    out["nbytes"], out["leaves"] = out["sizes"][first]
    return out


def _run_pass(
    name: str,
    scale: float,
    phases: list[str],
    with_orbax: bool,
    args: argparse.Namespace,
    scratch: Path,
    out: dict[str, Any],
) -> None:
    tree, abstract = TREES[name](scale, args.seed)
    nbytes, n_leaves = tree_bytes(tree), len(jax.tree_util.tree_leaves(tree))
    print(f"tree {name}: {n_leaves} leaves, {nbytes / MiB:.1f} MiB", flush=True)
    c = Contenders(tree, abstract, scratch, nbytes, args.reclaim_wait)
    c.first_save = lambda path: measure_memory("ckptstore", path, name, scale, args)["seconds"]
    asyncio.run(c.ckpt_save(keep=scratch / "restore_ckpt"))  # restore fixtures; warm-up
    if with_orbax:
        asyncio.run(c.orbax_save(keep=scratch / "restore_orbax"))
        asyncio.run(c.orbax_save(keep=scratch / "restore_orbax_raw", compress=False))
        written = {k: orbax_compressor(scratch / k) for k in ("restore_orbax", "restore_orbax_raw")}
        print(f"  Orbax's zarr compressor as written, default / off: {written}", flush=True)
        assert written["restore_orbax"] is not None and written["restore_orbax_raw"] is None
        out["orbax_compressor"] = written
    check_restores(c, with_orbax)
    for phase in phases:
        names = PHASES[phase]
        print(f"  {phase}: {args.reps} reps of {', '.join(names)} ...", flush=True)
        stats = asyncio.run(common.interleave(args.reps, [getattr(c, n) for n in names]))
        out["timings"].update({f"{phase}:{n}": st for n, st in zip(names, stats, strict=True)})
        out["sizes"][phase] = (nbytes, n_leaves)


def _peaks(
    name: str, scale: float, args: argparse.Namespace, scratch: Path
) -> dict[str, list[dict[str, float]]]:
    """Peak memory of saves and restores of the tree, each in a fresh process."""
    print(f"  peak memory: {args.memory_reps} reps, fresh processes ...", flush=True)
    where = {
        "ckptstore": scratch / "mem_ckptstore",
        "orbax": scratch / "mem_orbax",
        "ckptstore-restore": scratch / "restore_ckpt",
        "orbax-restore": scratch / "restore_orbax",
    }
    peaks: dict[str, list[dict[str, float]]] = {}
    for rep in range(args.memory_reps):
        for tool in sorted(where, reverse=rep % 2 == 1):
            if tool.endswith("-restore"):  # cold, as a restarted job's first restore
                evict_tree(where[tool])
            peaks.setdefault(tool, []).append(measure_memory(tool, where[tool], name, scale, args))
    return peaks


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    per_tree = {
        name: run_tree(name, args, scratch, memory=i == 0) for i, name in enumerate(args.trees)
    }
    first = per_tree[args.trees[0]]
    memory = first["memory"]
    sizes = first["sizes"]  # the memory runs in the Orbax phases' pass, at its size
    memory_bytes = next((sizes[p][0] for p in ORBAX_PHASES if p in sizes), first["nbytes"])
    print(f"merge: {args.merge_stores} stores x {args.merge_store_mib} MiB ...", flush=True)
    size = args.merge_store_mib * MiB
    merged = asyncio.run(bench_merge(scratch, args.reps, args.merge_stores, size))
    return {"trees": per_tree, "memory": memory, "memory_bytes": memory_bytes, "merge": merged}


def evaluate(r: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per comparison: both figures, the ratio, the floor and the verdict."""
    keys = ("name", "ckptstore", "baseline", "ratio", "floor", "pass")
    out: list[dict[str, Any]] = []

    def add(*cells: Any) -> None:
        out.append(dict(zip(keys, cells, strict=True)))

    for tree, t in r["trees"].items():
        m = t["timings"]
        for label, phase, a, b, f in TIME_ROWS:
            if phase not in t["sizes"]:  # not run (--phases)
                continue
            n, leaves = t["sizes"][phase]

            def rate(k: str, n: int = n, m: dict[str, Any] = m) -> str:
                st = m[k]
                spread = f"{st.min:.2f}-{st.max:.2f}"
                return f"{st.median:.3f} s ({spread}), {common.gbps(n, st.median):.2f} GB/s"

            floor_x = SAVE_VS_DD[tree] if f == "dd" else f
            ratio = m[f"{phase}:{b}"].median / m[f"{phase}:{a}"].median
            floor, ok = (None, None) if floor_x is None else (f">= {floor_x}x", ratio >= floor_x)
            name = f"{tree}: {label}" + (f" ({leaves} leaves)" if leaves != t["leaves"] else "")
            add(name, rate(f"{phase}:{a}"), f"{b}: {rate(f'{phase}:{b}')}", ratio, floor, ok)
    mem = r["memory"]
    first = r["memory_bytes"]
    if mem.get("ckptstore"):

        def peak(tool: str, key: str = "peak_added") -> float:
            return float(np.median([m[key] for m in mem[tool]]))

        ck, ob = peak("ckptstore"), peak("orbax")
        base, frac = f"orbax: {ob / MiB:.0f} MiB ({ob / first:.2f}x state)", ck / first
        cells = (f"{ck / MiB:.0f} MiB", base, frac, f"<= {MEMORY_FLOOR}x state")
        add("peak memory added by a save", *cells, frac <= MEMORY_FLOOR)
        # A restore on CPU devices adds the restored state itself; the rest is overhead.
        state, largest = (
            peak("ckptstore-restore", "restored_bytes"),
            peak("ckptstore-restore", "largest_shard"),
        )
        ck, ob = peak("ckptstore-restore") - state, peak("orbax-restore") - state
        bound = RESTORE_INFLIGHT + largest
        base = f"orbax: {ob / MiB:.0f} MiB over the state"
        cells = (f"{ck / MiB:.0f} MiB over the state", base, ck / bound)
        add("restore memory over budget + largest shard", *cells, "<= 1.0x", ck <= bound)
        # The same restores timed: each the first of a fresh process, as after a restart.
        times = {tool: [m["seconds"] for m in mem[tool]] for tool in mem}
        ck, ob = peak("ckptstore-restore", "seconds"), peak("orbax-restore", "seconds")

        def spread(tool: str, median: float) -> str:
            low, high = min(times[tool]), max(times[tool])
            return (
                f"{median:.3f} s ({low:.2f}-{high:.2f}), {common.gbps(int(state), median):.2f} GB/s"
            )

        ours, theirs = spread("ckptstore-restore", ck), "orbax: " + spread("orbax-restore", ob)
        name = "first restore of a fresh process (cold) vs Orbax"
        add(name, ours, theirs, ob / ck, ">= 1.5x", ob / ck >= 1.5)
    mg = r["merge"]
    ck_t, bare_t = mg["ckptstore"].median, mg["bare"].median
    grew = {k: int(np.median(v)) for k, v in mg["bytes_added"].items()}
    ck_s = f"{ck_t * 1e3:.1f} ms, +{grew['ckptstore']} B"
    bare_s = f"bare txn: {bare_t * 1e3:.1f} ms, +{grew['bare']} B"
    cells = (ck_s, bare_s, ck_t / bare_t, f"<= {MERGE_FLOOR}x bare", ck_t / bare_t <= MERGE_FLOOR)
    add("merge of per-process stores", *cells)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "info"}
    headers = ["measurement", "ckptstore (median)", "baseline (median)", "ratio", "floor", ""]
    cells = [
        [r["name"], r["ckptstore"], r["baseline"], f"{r['ratio']:.2f}x", r["floor"] or "-", v]
        for r, v in ((r, verdict[r["pass"]]) for r in rows)
    ]
    return common.markdown_table(headers, cells)


def to_json(args: argparse.Namespace, r: dict[str, Any], rows: list[Any], scratch: Path) -> Any:
    keys = "trees phases scale reps memory_reps merge_stores merge_store_mib seed".split()
    config, mg = {k: getattr(args, k) for k in keys}, r["merge"]
    return {
        "benchmark": "save_restore",
        "timestamp": common.utc_timestamp(),
        "command": " ".join(["python", "benchmarks/save_restore.py", *sys.argv[1:]]),
        "config": {
            **config,
            "ratio": "baseline median / ckptstore median (>1: ckptstore faster); memory: "
            "peak added / state bytes; merge: ckptstore median / bare median",
            "order": "per tree, phases (see PHASES; ORBAX_SCALE: trees whose Orbax phases run "
            "smaller), each interleaved; the first contender rotates every repetition",
            "page_cache": "not dropped (needs root); cold restores and the raw read evict "
            "their files' pages with POSIX_FADV_DONTNEED first; warm ones do not",
            "free_memory": "each timed operation first touches and frees twice the state's "
            "bytes (common.recycle_memory); the cold_reclaimed phase instead waits "
            f"{args.reclaim_wait} s for the host to take freed memory back",
            "orbax": "StandardCheckpointer defaults (zstd level 1); orbax_save_fsync adds an "
            "fsync of every file and directory; orbax_raw_*: compression off "
            "(AsyncCheckpointer(PyTreeCheckpointHandler(use_compression=False)), PyTreeSave), "
            "restored by the same StandardCheckpointer restore",
        },
        "machine": common.machine_info(PACKAGES, scratch),
        "trees": {
            name: {
                "bytes": t["nbytes"],
                "leaves": t["leaves"],
                "orbax_compressor": t.get("orbax_compressor"),
                "phase_sizes": {p: {"bytes": n, "leaves": k} for p, (n, k) in t["sizes"].items()},
                "timings": {
                    k: v.to_json(t["sizes"][k.split(":")[0]][0]) for k, v in t["timings"].items()
                },
            }
            for name, t in r["trees"].items()
        },
        "memory_peak_added_bytes": r["memory"],
        "merge": {
            "ckptstore": mg["ckptstore"].to_json(),
            "bare": mg["bare"].to_json(),
            "bytes_added": mg["bytes_added"],
            "bytes_in_stores": args.merge_stores * args.merge_store_mib * MiB,
        },
        "comparisons": [{**row, "ratio": round(row["ratio"], 4)} for row in rows],
        "all_floors_pass": all(row["pass"] is not False for row in rows),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default="a,b,c,d", help="trees to run (default a,b,c,d)")
    p.add_argument("--scale", type=float, help="tree size factor (default 1; 1/16 with --quick)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="phases to run (default all: " + ",".join(PHASES) + ")",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1/16 size (or --scale), 1 rep, 16 stores merged",
    )
    p.add_argument("--memory-reps", type=int, help="fresh-process saves (default min(reps, 3))")
    p.add_argument("--merge-stores", type=int, default=64, help="stores merged (default 64)")
    p.add_argument("--merge-store-mib", type=int, default=4, help="MiB per store (default 4)")
    p.add_argument("--scratch", type=Path, help="parent of the temporary directory")
    p.add_argument("--output", type=Path, default=common.RESULTS / "save_restore.json")
    p.add_argument("--no-write-results", action="store_true", help="do not write the JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 if any floor fails")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tree")
    p.add_argument(
        "--reclaim-wait",
        type=float,
        default=3.0,
        help="seconds the reclaimed phase waits for the host to take freed memory (default 3)",
    )
    tools = ["ckptstore", "orbax", "ckptstore-restore", "orbax-restore"]
    p.add_argument("--child-memory", choices=tools, help=argparse.SUPPRESS)
    p.add_argument("--child-path", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-tree", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if sorted(set(args.phases) - set(PHASES)) or not args.phases:
        p.error(f"unknown phases in {args.phases}; choose from {list(PHASES)}")
    unknown = sorted(set(args.trees) - set(TREES))
    if unknown or not args.trees:
        p.error(f"unknown trees {unknown}; choose from {sorted(TREES)}")
    if args.quick:
        args.reps, args.merge_stores, args.merge_store_mib = 1, 16, 1
        args.scale = 1 / 16 if args.scale is None else args.scale
        args.reclaim_wait = 0.1
        args.memory_reps = 1 if args.memory_reps is None else args.memory_reps
    if args.scale is None:
        args.scale = 1.0
    if args.memory_reps is None:
        args.memory_reps = min(args.reps, 3)
    if min(args.reps, args.merge_stores, args.merge_store_mib) < 1 or args.memory_reps < 0:
        p.error("--reps, --merge-stores and --merge-store-mib must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_memory:
        sizes = (args.child_tree, args.scale, args.seed)
        print(json.dumps(child_memory(args.child_memory, args.child_path, *sizes)))
        return 0
    with (
        common.sigterm_as_interrupt(),
        common.scratch_dir("ckptstore-save-restore-", args.scratch) as scratch,
    ):
        print(f"scratch directory: {scratch}", flush=True)
        result = run(args, scratch)
        rows = evaluate(result)
        payload = to_json(args, result, rows, scratch)
    print()
    print(table(rows))
    failed = [r["name"] for r in rows if r["pass"] is False]
    print("\nfloors: " + ("all PASS" if not failed else "FAIL: " + ", ".join(failed)))
    if not args.no_write_results:
        common.write_results(args.output, payload)
        print(f"results written to {args.output}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
