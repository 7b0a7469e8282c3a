"""Save/restore benchmark: a ~1 GiB sharded tree, ckptstore vs ``dd`` and Orbax, side by side.

Workload: 4 large float32 leaves sharded over a (4, 2) mesh of 8 CPU devices plus
300 small replicated leaves (4-64 KiB: biases, norms), random data. Measured in one
run, in phases (disk: ckptstore vs dd; orbax: ckptstore vs Orbax; restore), each
interleaved (the first contender rotates every repetition), medians:

- save: ``await ckptstore.save(path, tree, step=N)`` (durable: fsyncs) and without
  fsync (``LocalBackend(fsync=False)``); ``dd bs=16M oflag=direct conv=fsync`` of as
  many bytes (and, for reference, ``dd conv=fsync`` through the page cache); Orbax
  ``StandardCheckpointer().save`` + ``wait_until_finished()`` as is and followed by
  an fsync of every file and directory (equal durability);
- restore onto the same shardings: ``ckptstore.restore(like=...)`` vs Orbax
  ``restore(target=...)``, cold: the files' pages are evicted first
  (``POSIX_FADV_DONTNEED``; dropping the whole page cache needs root);
- peak resident memory a save adds (VmHWM over the RSS once the tree is built),
  each save in a fresh subprocess;
- merge of 64 per-process OCDBT stores: ``ckptstore.checkpoint.merge.merge`` vs the
  bare TensorStore transaction, and the bytes each adds on disk.

Floors: save >= 0.8x dd's throughput; save >= 1.5x faster than Orbax at equal
durability; restore at least as fast as Orbax; peak memory <= 0.25x the state;
merge <= 1.5x the bare transaction.

    python benchmarks/save_restore.py             # ~1 GiB, 5 reps
    python benchmarks/save_restore.py --quick     # 64 MiB, 2 reps (smoke test)
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
from collections.abc import Awaitable, Callable
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ckptstore
from benchmarks import common
from benchmarks.common import MiB, Timer
from ckptstore.arrays import ocdbt_spec, write_leaves
from ckptstore.backends.local import LocalBackend
from ckptstore.checkpoint.merge import merge
from ckptstore.leaves import describe_leaf

PACKAGES = ["ckptstore", "jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint", "psutil"]
N_LARGE = 4
# Each phase interleaves its contenders side by side. The disk comparison runs apart from
# Orbax: Orbax allocates and frees over 1 GiB per save, and on this VM freshly reported free
# pages make the next page-cache writes (ckptstore's and dd's buffered ones) erratically slow.
PHASES = {
    "disk": ["ckpt_save", "dd_direct", "dd_buffered"],
    "orbax": ["ckpt_save", "ckpt_save_nofsync", "orbax_save", "orbax_save_fsync"],
    "restore": ["ckpt_restore", "orbax_restore"],
}
# (label, phase, ckptstore's timing, baseline's timing, floor on baseline/ckptstore or None)
TIME_ROWS = [
    ("save (fsync) vs dd direct+fsync", "disk", "ckpt_save", "dd_direct", 0.8),
    ("save (fsync) vs dd buffered+fsync", "disk", "ckpt_save", "dd_buffered", None),
    ("save (fsync) vs Orbax + fsync", "orbax", "ckpt_save", "orbax_save_fsync", 1.5),
    ("save (fsync) vs Orbax as is", "orbax", "ckpt_save", "orbax_save", None),
    ("save (no fsync) vs Orbax as is", "orbax", "ckpt_save_nofsync", "orbax_save", None),
    ("restore (cold) vs Orbax", "restore", "ckpt_restore", "orbax_restore", 1.0),
]
MEMORY_FLOOR = 0.25  # peak added / state bytes
MERGE_FLOOR = 1.5  # ckptstore time / bare time


# ---- workload ---------------------------------------------------------------------------


def build_tree(total: int, n_small: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tree (jax arrays on a (4, 2) mesh) and its abstract twin (ShapeDtypeStructs)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    sharded = NamedSharding(mesh, PartitionSpec("data", "model"))
    replicated = NamedSharding(mesh, PartitionSpec())
    small = [int(n) for n in np.random.default_rng(seed).integers(1024, 16385, n_small)]
    cols = 8192 if total >= 256 * MiB else 1024
    rows = max(8, (total - 4 * sum(small)) // (N_LARGE * cols * 4) // 8 * 8)

    def fill(shape: tuple[int, ...], sharding: NamedSharding, salt: int) -> jax.Array:
        def piece(index: tuple[slice, ...]) -> np.ndarray[Any, Any]:
            shard = [len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True)]
            rng = np.random.default_rng([seed, salt, *(s.start or 0 for s in index)])
            return rng.random(shard, dtype=np.float32)

        return jax.make_array_from_callback(shape, sharding, piece)

    tree: dict[str, Any] = {"params": {}, "opt_state": {}}
    for i in range(N_LARGE):  # embeddings and MLP kernels
        tree["params"][f"layer_{i}"] = {"kernel": fill((rows, cols), sharded, i)}
    for j, n in enumerate(small):  # biases, norms, optimizer statistics
        group = tree["params"] if j % 2 == 0 else tree["opt_state"]
        group.setdefault(f"block_{j // 6}", {})[f"v{j % 6}"] = fill((n,), replicated, 1000 + j)
    jax.block_until_ready(tree)
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
    )
    return tree, abstract


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
    for p in files_below(path):
        _with_fd(p, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def orbax_save(tree: Any, path: Path, fsync: bool = False) -> None:
    """Orbax's `StandardCheckpointer` save, finished; then optionally fsync everything."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(path, tree)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    if fsync:
        fsync_tree(path)


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

    def __init__(self, tree: Any, abstract: Any, scratch: Path, nbytes: int) -> None:
        self.tree, self.abstract, self.scratch = tree, abstract, scratch
        self.count = 0
        self.src = scratch / "dd_source.bin"  # as many random bytes, cached
        with open(self.src, "wb") as f:
            rng = np.random.default_rng(1)
            for off in range(0, nbytes, 64 * MiB):
                f.write(rng.bytes(min(64 * MiB, nbytes - off)))

    def fresh(self, name: str) -> Path:
        self.count += 1
        return self.scratch / f"{name}_{self.count}"

    def _dd(self, *flags: str) -> float:
        dst = self.fresh("dd")
        with Timer() as t:
            cmd = ["dd", f"if={self.src}", f"of={dst}", "bs=16M", *flags, "status=none"]
            subprocess.run(cmd, check=True)
        dst.unlink()
        return t.seconds

    async def dd_direct(self) -> float:
        return self._dd("oflag=direct", "conv=fsync")

    async def dd_buffered(self) -> float:
        return self._dd("conv=fsync")

    async def ckpt_save(self, fsync: bool = True, keep: Path | None = None) -> float:
        path = keep or self.fresh("ckpt")
        target: Any = str(path) if fsync else LocalBackend(path, fsync=False)
        with Timer() as t:
            await ckptstore.save(target, self.tree, step=self.count)
        if keep is None:
            shutil.rmtree(path)
        return t.seconds

    async def ckpt_save_nofsync(self) -> float:
        return await self.ckpt_save(fsync=False)

    async def orbax_save(self, fsync: bool = False, keep: Path | None = None) -> float:
        path = keep or self.fresh("orbax")
        with Timer() as t:  # Orbax runs its own event loop: keep it off ours
            await asyncio.to_thread(orbax_save, self.tree, path, fsync)
        if keep is None:
            shutil.rmtree(path)
        return t.seconds

    async def orbax_save_fsync(self) -> float:
        return await self.orbax_save(fsync=True)

    async def ckpt_restore(self) -> float:
        path = self.scratch / "restore_ckpt"
        evict_tree(path)
        with Timer() as t:
            jax.block_until_ready(await ckptstore.restore(str(path), like=self.abstract))
        return t.seconds

    async def orbax_restore(self) -> float:
        evict_tree(self.scratch / "restore_orbax")
        with Timer() as t:
            await asyncio.to_thread(orbax_restore, self.scratch / "restore_orbax", self.abstract)
        return t.seconds


def check_restores(c: Contenders) -> None:
    """Both tools give back the saved values with the requested shardings."""
    got_ck = asyncio.run(ckptstore.restore(str(c.scratch / "restore_ckpt"), like=c.abstract))
    want = jax.tree_util.tree_leaves(c.tree)
    got_ob = orbax_restore(c.scratch / "restore_orbax", c.abstract)
    for name, got in (("ckptstore", got_ck), ("orbax", got_ob)):
        for a, b in zip(want, jax.tree_util.tree_leaves(got), strict=True):
            if a.sharding != b.sharding or not np.array_equal(np.asarray(a), np.asarray(b)):
                raise AssertionError(f"{name} restored something else than it saved")


# ---- peak memory (fresh processes) ----------------------------------------------------------


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child_memory(tool: str, path: Path, size: int, n_small: int, seed: int) -> dict[str, int]:
    """Build the tree, save it once, return the resident memory the save added at its peak."""
    tree, _ = build_tree(size, n_small, seed)
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
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if tool == "ckptstore":
        asyncio.run(ckptstore.save(str(path), tree, step=1))
    else:
        orbax_save(tree, path)
    stop.set()
    sampler.join()
    peak = max(_status_bytes("VmHWM") if hwm else 0, *samples)
    return {"baseline_rss": baseline, "peak_added": peak - baseline}


def measure_memory(tool: str, path: Path, args: argparse.Namespace) -> int:
    cmd = [sys.executable, __file__, "--child-memory", tool, "--child-path", str(path)]
    cmd += ["--size-mib", str(args.size_mib), "--small-leaves", str(args.small_leaves)]
    out = subprocess.run([*cmd, "--seed", str(args.seed)], check=True, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    return int(json.loads(out.stdout.decode().strip().splitlines()[-1])["peak_added"])


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


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    tree, abstract = build_tree(args.size_mib * MiB, args.small_leaves, args.seed)
    nbytes, n_leaves = tree_bytes(tree), len(jax.tree_util.tree_leaves(tree))
    print(f"tree: {n_leaves} leaves, {nbytes / MiB:.1f} MiB", flush=True)
    c = Contenders(tree, abstract, scratch, nbytes)
    asyncio.run(c.ckpt_save(keep=scratch / "restore_ckpt"))  # restore fixtures; warm-up
    asyncio.run(c.orbax_save(keep=scratch / "restore_orbax"))
    check_restores(c)
    timings = {}
    for phase, names in PHASES.items():
        print(f"{phase}: {args.reps} reps of {', '.join(names)} ...", flush=True)
        stats = asyncio.run(common.interleave(args.reps, [getattr(c, n) for n in names]))
        timings.update({f"{phase}:{n}": st for n, st in zip(names, stats, strict=True)})
    memory: dict[str, list[int]] = {"ckptstore": [], "orbax": []}
    print(f"peak memory: {args.memory_reps} reps, fresh processes ...", flush=True)
    for rep in range(args.memory_reps):
        for tool in sorted(memory, reverse=rep % 2 == 1):
            memory[tool].append(measure_memory(tool, scratch / f"mem_{tool}", args))
    print(f"merge: {args.merge_stores} stores x {args.merge_store_mib} MiB ...", flush=True)
    size = args.merge_store_mib * MiB
    merged = asyncio.run(bench_merge(scratch, args.reps, args.merge_stores, size))
    return {
        "nbytes": nbytes,
        "leaves": n_leaves,
        "timings": timings,
        "memory": memory,
        "merge": merged,
    }


def evaluate(r: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per comparison: both figures, the ratio, the floor and the verdict."""
    n, m, mg = r["nbytes"], {k: v.median for k, v in r["timings"].items()}, r["merge"]
    keys = ("name", "ckptstore", "baseline", "ratio", "floor", "pass")
    out: list[dict[str, Any]] = []

    def add(*cells: Any) -> None:
        out.append(dict(zip(keys, cells, strict=True)))

    def rate(k: str) -> str:
        return f"{m[k]:.3f} s, {common.gbps(n, m[k]):.2f} GB/s"

    for label, phase, a, b, f in TIME_ROWS:
        ratio = m[f"{phase}:{b}"] / m[f"{phase}:{a}"]
        floor, ok = (None, None) if f is None else (f">= {f}x", ratio >= f)
        add(label, rate(f"{phase}:{a}"), f"{b}: {rate(f'{phase}:{b}')}", ratio, floor, ok)
    if r["memory"]["ckptstore"]:
        ck, ob = (float(np.median(r["memory"][k])) for k in ("ckptstore", "orbax"))
        base, frac = f"orbax: {ob / MiB:.0f} MiB ({ob / n:.2f}x state)", ck / n
        cells = (f"{ck / MiB:.0f} MiB", base, frac, f"<= {MEMORY_FLOOR}x state")
        add("peak memory added by a save", *cells, frac <= MEMORY_FLOOR)
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
    keys = "size_mib reps memory_reps small_leaves merge_stores merge_store_mib seed".split()
    config, mg = {k: getattr(args, k) for k in keys}, r["merge"]
    return {
        "benchmark": "save_restore",
        "timestamp": common.utc_timestamp(),
        "command": " ".join(["python", "benchmarks/save_restore.py", *sys.argv[1:]]),
        "config": {
            **config,
            "large_leaves": N_LARGE,
            "mesh": [4, 2],
            "ratio": "baseline median / ckptstore median (>1: ckptstore faster); memory: "
            "peak added / state bytes; merge: ckptstore median / bare median",
            "order": "phases (see PHASES), each interleaved; the first contender rotates "
            "every repetition",
            "page_cache": "not dropped (needs root); restores evict the checkpoint's pages "
            "with POSIX_FADV_DONTNEED first; the dd source file is cached",
            "orbax": "StandardCheckpointer defaults (zstd); orbax_save_fsync adds an fsync of "
            "every file and directory",
        },
        "machine": common.machine_info(PACKAGES, scratch),
        "tree": {"bytes": r["nbytes"], "leaves": r["leaves"]},
        "timings": {k: v.to_json(r["nbytes"]) for k, v in r["timings"].items()},
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
    p.add_argument("--size-gib", type=float, default=1.0, help="tree size (default 1)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 64 MiB, 2 reps, 16 stores merged"
    )
    p.add_argument("--small-leaves", type=int, default=300, help="small leaves (default 300)")
    p.add_argument("--memory-reps", type=int, help="fresh-process saves (default min(reps, 3))")
    p.add_argument("--merge-stores", type=int, default=64, help="stores merged (default 64)")
    p.add_argument("--merge-store-mib", type=int, default=4, help="MiB per store (default 4)")
    p.add_argument("--scratch", type=Path, help="parent of the temporary directory")
    p.add_argument("--output", type=Path, default=common.RESULTS / "save_restore.json")
    p.add_argument("--no-write-results", action="store_true", help="do not write the JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 if any floor fails")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tree")
    p.add_argument("--size-mib", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-memory", choices=["ckptstore", "orbax"], help=argparse.SUPPRESS)
    p.add_argument("--child-path", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib, args.reps, args.merge_stores, args.merge_store_mib = 1 / 16, 2, 16, 1
        args.small_leaves = min(args.small_leaves, 60)
        args.memory_reps = 1 if args.memory_reps is None else args.memory_reps
    if args.size_mib is None:
        args.size_mib = max(1, round(args.size_gib * 1024))
    if args.memory_reps is None:
        args.memory_reps = min(args.reps, 3)
    if min(args.reps, args.merge_stores, args.merge_store_mib) < 1 or args.memory_reps < 0:
        p.error("--reps, --merge-stores and --merge-store-mib must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_memory:
        sizes = (args.size_mib * MiB, args.small_leaves, args.seed)
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
