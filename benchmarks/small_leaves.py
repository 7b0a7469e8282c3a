"""Writing thousands of small leaves: OCDBT raw keys vs packs vs ``dd``, side by side.

Tree ``c`` of ``benchmarks/trees.py`` (5,000 replicated leaves of 16 KiB to 1 MiB,
1.15 GiB) written durably into a fresh directory three ways, interleaved (the first
contender rotates every repetition), medians with their spread:

- ``ocdbt_keys``: what a save does with them today, `ckptstore.datapath.arrays.write_leaves`
  into one OCDBT store (two keys a leaf through TensorStore's ``KvStore.write``,
  its data files fsync'd, written pages dropped as in a save);
- ``packs``: `ckptstore.datapath.packs.write_pack`, one pack per group of up to 64 MiB
  (`ckptstore.format.chunks.groups`), all groups at once (O_DIRECT gathered writes);
- ``dd_direct``: ``dd bs=16M oflag=direct conv=fsync`` of as many bytes.

Only the data: no merge, commit or manifest (a save adds those).

    python benchmarks/small_leaves.py              # full size, 5 reps
    python benchmarks/small_leaves.py --quick      # 1/16 size, 2 reps
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from benchmarks import common
from benchmarks.common import MiB, Timer
from benchmarks.trees import tree_c
from ckptstore.backends.local import LocalBackend
from ckptstore.datapath.arrays import write_leaves
from ckptstore.datapath.packs import write_pack
from ckptstore.datapath.stores import ocdbt_spec
from ckptstore.format import chunks
from ckptstore.format.leaves import describe_leaf

CONTENDERS = ["ocdbt_keys", "packs", "dd_direct"]
PACK_BYTES = 64 * MiB


class Writers:
    """One runner per contender; each writes into a fresh directory below ``scratch``."""

    def __init__(self, scratch: Path, leaves: list[tuple[Any, Any]]):
        self.scratch = scratch
        self.leaves = leaves
        self.nbytes = sum(info.nbytes for info, _ in leaves)

    def fresh(self) -> LocalBackend:
        out = self.scratch / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        return LocalBackend(out)

    async def ocdbt_keys(self) -> float:
        backend = self.fresh()
        spec = ocdbt_spec(backend.kvstore_spec("p0"))
        with Timer() as t, backend.write_behind("p0"):
            await write_leaves(
                spec, backend.ts_context, self.leaves, process=0, write_metadata=True
            )
        return t.seconds

    async def packs(self) -> float:
        backend = self.fresh()
        groups = chunks.groups([(i, np.asarray(v)) for i, v in self.leaves], PACK_BYTES)
        with Timer() as t:
            await asyncio.gather(
                *(write_pack(backend, "p0", f"pack-{k}", g) for k, g in enumerate(groups))
            )
        return t.seconds

    async def dd_direct(self) -> float:
        self.fresh()
        count = max(1, self.nbytes // (16 * MiB))
        cmd = ["dd", "if=/dev/zero", f"of={self.scratch / 'out' / 'dd'}", "bs=16M"]
        with Timer() as t:
            subprocess.run(
                [*cmd, f"count={count}", "oflag=direct", "conv=fsync", "status=none"], check=True
            )
        return t.seconds


async def run(scale: float, reps: int, scratch: Path) -> dict[str, Any]:
    tree, _ = tree_c(scale, 0)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [(describe_leaf(jax.tree_util.keystr(path), value), value) for path, value in flat]
    writers = Writers(scratch, leaves)
    stats = await common.interleave(reps, [getattr(writers, name) for name in CONTENDERS])
    return {
        "leaves": len(leaves),
        "bytes": writers.nbytes,
        "results": {n: s.to_json(writers.nbytes) for n, s in zip(CONTENDERS, stats, strict=True)},
        "dd_over": {
            n: round(stats[-1].median / s.median, 3)
            for n, s in zip(CONTENDERS[:-1], stats[:-1], strict=True)
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="tree size factor (default 1)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--quick", action="store_true", help="1/16 size, 2 reps")
    p.add_argument("--output", type=Path, default=common.RESULTS / "small_leaves.json")
    p.add_argument("--no-write-results", action="store_true")
    args = p.parse_args(argv)
    scale, reps = (1 / 16, 2) if args.quick else (args.scale, args.reps)
    with common.sigterm_as_interrupt(), common.scratch_dir("ckpt-small-") as scratch:
        print(f"scratch directory: {scratch}")
        out = common.run_async(run(scale, reps, scratch))
    rows = []
    for name in CONTENDERS:
        r = out["results"][name]
        ratio = out["dd_over"].get(name)
        rows.append(
            [
                name,
                f"{r['median_s']:.3f} s ({r['min_s']:.2f}-{r['max_s']:.2f})",
                f"{r['median_gbps']:.2f} GB/s",
                f"{ratio:.2f}x" if ratio is not None else "-",
            ]
        )
    print(f"{out['leaves']} leaves, {out['bytes'] / MiB:.0f} MiB, {reps} reps, interleaved")
    print(common.markdown_table(["writer", "median (spread)", "throughput", "dd / it"], rows))
    if not args.no_write_results:
        payload = {"machine": common.machine_info(["ckptstore", "tensorstore", "numpy"], scratch)}
        common.write_results(args.output, {**payload, "scale": scale, "reps": reps, **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
