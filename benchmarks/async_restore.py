"""``asyncio.run(ckptstore.restore(...))`` against ``restore_sync``, side by side.

A 434 MiB tree (4 float32 leaves of 8192 x 3472, sharded over a (4, 2) mesh of CPU devices)
is saved once; then each repetition restores it, files evicted first, three ways in turn:
``asyncio.run(ckptstore.restore(root, step=1, like=like))``, ``restore_sync`` with the same
arguments, and the first again with `reprlib` asking each jax array for its full repr, as
before `ckptstore.runtime.shortrepr` (the cost Python 3.11's `asyncio.run` added: see there).
Prints medians, min and max of each, and writes them to
``benchmarks/results/async_restore.json``.

    python benchmarks/async_restore.py [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import reprlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks import common
from benchmarks.save_restore import evict_tree
from ckptstore.runtime import shortrepr

SHAPE = (8192, 3472)
LEAVES = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    on = NamedSharding(mesh, P("x", "y"))
    like = {f"w{i}": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=on) for i in range(LEAVES)}
    with common.scratch_dir("async_restore") as scratch:
        root = str(scratch / "ckpt")
        tree = {
            name: jax.device_put(np.random.default_rng(i).random(SHAPE, np.float32), on)
            for i, name in enumerate(like)
        }
        ckptstore.save_sync(root, tree, step=1)
        del tree

        def natural() -> Any:
            return asyncio.run(ckptstore.restore(root, step=1, like=like))

        def twin() -> Any:
            return ckptstore.restore_sync(root, step=1, like=like)

        def unfixed() -> Any:
            for name in shortrepr._ARRAY_TYPES:
                delattr(reprlib.aRepr, f"repr_{name}")
            try:
                return natural()
            finally:
                shortrepr.install()

        ways: dict[str, Callable[[], Any]] = {
            "asyncio.run(restore(...))": natural,
            "restore_sync(...)": twin,
            "asyncio.run(restore(...)), full reprs (before)": unfixed,
        }
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, way in ways.items():
                evict_tree(Path(root))
                start = time.perf_counter()
                jax.block_until_ready(way())
                seconds[name].append(time.perf_counter() - start)
    rows = []
    for name, times in seconds.items():
        med = statistics.median(times)
        rows.append([name, f"{med:.3f}", f"{min(times):.3f}", f"{max(times):.3f}"])
        print(f"{name:48s} median {med:.3f} s  min {min(times):.3f}  max {max(times):.3f}")
    common.write_results(
        Path(__file__).parent / "results" / "async_restore.json",
        {
            "when": common.utc_timestamp(),
            "machine": common.machine_info(["jax", "tensorstore"]),
            "tree": {"leaves": LEAVES, "shape": list(SHAPE), "dtype": "float32", "mesh": [4, 2]},
            "reps": args.reps,
            "page_cache": "each restore's files evicted first (POSIX_FADV_DONTNEED)",
            "seconds": seconds,
            "table": common.markdown_table(["way", "median s", "min s", "max s"], rows),
        },
    )


if __name__ == "__main__":
    main()
