"""OCDBT's data file size (`ckptstore.datapath.stores.DATA_FILE_BYTES`) on local disk.

Each process's OCDBT store starts a new data file once the one being filled holds
``target_data_file_size`` bytes; smaller files are written (and fsync'd) earlier, beside
the chunks still being encoded. This benchmark saves the same trees with each candidate
size, interleaved (the first contender rotates every repetition), and restores each
saved checkpoint cold (its pages evicted), interleaved the same way:

- trees ``a``, ``b`` and ``d`` of ``benchmarks/trees.py`` (``c`` is packs of small
  leaves, which OCDBT data files do not hold);
- the training-loop benchmark's states of 192 MiB and 1 GiB (16 leaves over 8 devices).

Saves are durable (ckptstore fsyncs before its commit returns). The ratio is the
median save (or restore) time with the first size over the second's.

    python benchmarks/data_files.py                     # 16 vs 64 MiB, 6 reps
    python benchmarks/data_files.py --sizes 8,16,64     # more candidates
    python benchmarks/data_files.py --quick             # 1/16 size, 2 reps (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax

import ckptstore
from benchmarks import common
from benchmarks.common import MiB
from benchmarks.save_restore import evict_tree, tree_bytes
from benchmarks.training_loop import make_state
from benchmarks.trees import TREES, abstract_of
from ckptstore.datapath import stores

RESULTS = Path(__file__).resolve().parent / "results" / "data_files.json"


def workloads(scale: float) -> dict[str, Callable[[], Any]]:
    """Builders of each measured tree (built one at a time: a few GiB in all)."""
    out: dict[str, Callable[[], Any]] = {
        name: (lambda name=name: TREES[name](scale, 0)[0]) for name in ("a", "b", "d")
    }
    out["state 192 MiB"] = lambda: make_state(int(192 * MiB * scale))
    out["state 1 GiB"] = lambda: make_state(int(1024 * MiB * scale))
    return out


async def measure(tree: Any, sizes: list[int], reps: int, scratch: Path) -> dict[str, Any]:
    """Saves and cold restores of ``tree`` with each data file size, interleaved."""
    like = abstract_of(tree)

    def saver(mib: int) -> common.Runner:
        async def run() -> float:
            path = scratch / f"save_{mib}"
            shutil.rmtree(path, ignore_errors=True)
            os.sync()  # earlier repetitions' writeback does not land in this one
            stores.DATA_FILE_BYTES = mib * MiB
            with common.Timer() as t:
                await ckptstore.save(str(path), tree, step=1)
            shutil.rmtree(path)
            return t.seconds

        return run

    def restorer(mib: int) -> common.Runner:
        path = scratch / f"restore_{mib}"

        async def run() -> float:
            evict_tree(path)
            with common.Timer() as t:
                got = jax.block_until_ready(await ckptstore.restore(str(path), like=like))
            del got  # freeing what a restore returns is not part of it
            return t.seconds

        return run

    previous = stores.DATA_FILE_BYTES
    try:
        saves = await common.interleave(reps, [saver(m) for m in sizes])
        for mib in sizes:  # the checkpoints the restores read, one per size
            stores.DATA_FILE_BYTES = mib * MiB
            await ckptstore.save(str(scratch / f"restore_{mib}"), tree, step=1)
        restores = await common.interleave(reps, [restorer(m) for m in sizes])
    finally:
        stores.DATA_FILE_BYTES = previous
    files = {}
    for mib in sizes:  # count, then remove: the next tree saves its own
        path = scratch / f"restore_{mib}"
        files[mib] = sum(1 for p in path.rglob("*") if p.parent.name == "d")
        shutil.rmtree(path)
    return {
        "bytes": tree_bytes(tree),
        "save": {str(m): s.to_json() for m, s in zip(sizes, saves, strict=True)},
        "restore": {str(m): s.to_json() for m, s in zip(sizes, restores, strict=True)},
        "data_files": {str(m): n for m, n in files.items()},
    }


def _cell(stats: dict[str, Any]) -> str:
    return f"{stats['median_s']:.3f} ({stats['min_s']:.3f}-{stats['max_s']:.3f})"


def table(results: dict[str, Any], sizes: list[int]) -> str:
    first, second = (str(m) for m in sizes[:2])
    rows = []
    for name, got in results.items():
        for op in ("save", "restore"):
            cells = [_cell(got[op][str(m)]) for m in sizes]
            ratio = got[op][first]["median_s"] / got[op][second]["median_s"]
            rows.append([name, op, *cells, f"{ratio:.2f}x"])
    headers = ["tree", "operation", *(f"{m} MiB files: s" for m in sizes)]
    return common.markdown_table([*headers, f"{first} vs {second} MiB"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64", help="data file sizes in MiB (first two compared)")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--only", help="comma-separated workload names (default: all)")
    p.add_argument("--quick", action="store_true", help="1/16 size, 2 reps (smoke test)")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.reps = 1 / 16, 2
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) < 2:
        p.error("--sizes needs at least two sizes")
    chosen = workloads(args.scale)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    results: dict[str, Any] = {}
    with common.scratch_dir("ckptstore-datafiles-") as scratch:
        machine = common.machine_info(["ckptstore", "jax", "tensorstore"], scratch)
        for name, build in chosen.items():
            print(f"  {name} ...", flush=True)
            tree = build()
            results[name] = asyncio.run(measure(tree, sizes, args.reps, scratch))
            del tree
            common.release_memory()
    print(table(results, sizes))
    common.write_results(
        args.output,
        {
            "benchmark": "data_files",
            "when": common.utc_timestamp(),
            "machine": machine,
            "sizes_mib": sizes,
            "reps": args.reps,
            "scale": args.scale,
            "results": results,
            "table": table(results, sizes),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
