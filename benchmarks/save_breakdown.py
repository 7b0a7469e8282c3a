"""Where a save's time goes: phases per tree, and the fixed costs behind them.

For each tree of ``benchmarks/trees.py``: the median wall and CPU seconds of a
save and of its phases (``SaveResult.timings``: this process's writes, the
merge, the commit), and of a restore onto the saved shardings. Then the costs
that decided the data path's design, each measured side by side:

- opening one leaf's TensorStore array (``ts.open`` of a zarr3 spec in an OCDBT
  store) vs writing its two keys directly (`ckptstore.format.chunks`), per leaf;
- TensorStore's crc32c codec on a 64 MiB chunk (write and read, with vs without
  the codec) vs ckptstore's own check (`chunks.checksum`, the ``crc32c`` package) over
  the same bytes.

    python benchmarks/save_breakdown.py                # trees a,b,c,d, 3 reps
    python benchmarks/save_breakdown.py --quick        # 1/16 size, 1 rep
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
import tensorstore as ts

import ckptstore
from benchmarks import common
from benchmarks.common import MiB
from benchmarks.trees import TREES
from ckptstore.datapath.stores import ocdbt_spec
from ckptstore.format import chunks
from ckptstore.format.leaves import LeafInfo, zarr_spec


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def tree_rows(name: str, scale: float, reps: int, scratch: Path) -> list[list[str]]:
    tree, abstract = TREES[name](scale, 0)
    nbytes = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree))
    n_leaves = len(jax.tree_util.tree_leaves(tree))
    got: dict[str, list[float]] = {}
    for rep in range(reps + 1):  # the first is a warm-up
        path = scratch / f"{name}_{rep}"
        wall, cpu = time.perf_counter(), time.process_time()
        result = asyncio.run(ckptstore.save(str(path), tree, step=1))
        save = {"save": time.perf_counter() - wall, "save cpu": time.process_time() - cpu}
        wall, cpu = time.perf_counter(), time.process_time()
        restored = jax.block_until_ready(asyncio.run(ckptstore.restore(str(path), like=abstract)))
        save |= {"restore": time.perf_counter() - wall, "restore cpu": time.process_time() - cpu}
        del restored  # freeing what a restore returns is not part of it
        shutil.rmtree(path)
        if rep:
            for k, v in {**save, **result.timings}.items():
                got.setdefault(k, []).append(v)
    label = f"{name}: {n_leaves} leaves, {nbytes / MiB:.0f} MiB"
    keys = ["save", "save cpu", "write", "merge", "commit", "restore", "restore cpu"]
    return [[label, k, _median(got[k])] for k in keys if k in got]


async def open_vs_keys(n: int, scratch: Path) -> tuple[float, float]:
    """Seconds per leaf: a TensorStore open (create) vs writing the leaf's keys raw."""
    values = [np.full((256,), i, np.float32) for i in range(n)]
    infos = [LeafInfo(f"x{i}", (256,), "float32", (256,), "numpy") for i in range(n)]
    ctx = ts.Context()
    store = ocdbt_spec({"driver": "file", "path": str(scratch / "opens") + "/"})
    start = time.perf_counter()
    await asyncio.gather(*(ts.open(zarr_spec(store, i), create=True, context=ctx) for i in infos))
    opened = (time.perf_counter() - start) / n
    kv = await ts.KvStore.open(ocdbt_spec({"driver": "file", "path": str(scratch / "raw") + "/"}))
    start = time.perf_counter()
    futures = []
    for info, value in zip(infos, values, strict=True):
        futures.append(kv.write(chunks.metadata_key(info), chunks.encode_metadata(info)))
        futures.append(kv.write(chunks.chunk_key(info), chunks.encode_chunk(info, value)))
    for future in futures:
        future.result()
    raw = (time.perf_counter() - start) / n
    return opened, raw


def crc_costs(reps: int) -> dict[str, float]:
    """Milliseconds for a 64 MiB chunk: TensorStore write/read with and without crc32c."""
    value = np.random.default_rng(0).random((4096, 4096), dtype=np.float32)
    out: dict[str, list[float]] = {}
    for codec in ("crc32c", "none"):
        info = LeafInfo("x", value.shape, "float32", value.shape, "numpy")
        spec = zarr_spec({"driver": "memory"}, info)
        if codec == "none":
            spec["metadata"]["codecs"] = spec["metadata"]["codecs"][:1]
        arr = ts.open(spec, create=True, context=ts.Context()).result()
        for _ in range(reps + 1):
            start = time.perf_counter()
            arr.write(value).result()
            out.setdefault(f"write {codec}", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            arr.read().result()
            out.setdefault(f"read {codec}", []).append(time.perf_counter() - start)
    for _ in range(reps + 1):
        start = time.perf_counter()
        chunks.checksum(value.reshape(-1).view(np.uint8))
        out.setdefault("chunks.checksum", []).append(time.perf_counter() - start)
    return {k: statistics.median(v[1:]) * 1e3 for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default="a,b,c,d")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1/16 size, 1 rep")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.reps = 1 / 16, 1
    with common.scratch_dir("ckptstore-breakdown-", None) as scratch:
        rows = []
        for name in args.trees.split(","):
            rows += tree_rows(name, args.scale, args.reps, scratch)
        print(common.markdown_table(["tree", "phase", "seconds: median (min-max)"], rows))
        opened, raw = asyncio.run(open_vs_keys(2000 if not args.quick else 200, scratch))
        print(f"\nper leaf: TensorStore open {opened * 1e3:.3f} ms, raw keys {raw * 1e3:.3f} ms")
        costs = crc_costs(args.reps + 2)
        print("64 MiB chunk, ms: " + ", ".join(f"{k} {v:.0f}" for k, v in costs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
