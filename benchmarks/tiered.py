"""Tiered benchmark: saves on local disk (the NVMe tier) promoted to S3 (moto, in a child process).

Workload: 4 float32 leaves sharded over a (4, 2) mesh of 8 CPU devices plus 50 small
leaves, ~256 MiB. Per repetition (the order of the first pair alternates, so the default
6 repetitions give each order 3 times: whichever save goes first in a repetition took
~0.2 s longer in runs of 2026-12-05, and an odd count tilts the medians by that much):

- save return: ``ckptstore.save(local, tree)`` vs a ``CheckpointManager`` on
  ``Tiered(local, s3)``: ``save(...).wait()`` (committed on the fast tier); then
  ``wait_until_finished()`` (promoted and committed on S3), reported as save to durable;
- promotion: ``ckptstore.tiers.promote.promote_step`` of one committed step to a fresh
  S3 prefix vs ``s3fs`` ``put`` of the same attempt directory (recursive), same bytes.

- first save: in fresh processes (alternating), after one untimed local save that pays
  JAX's and TensorStore's start-up, the first ``save_sync`` of a 1 MiB tree to
  ``Tiered(local, s3)`` vs the first to local disk alone: a save on tiers must not wait for
  the durable tier's client. ``FIRST_SAVE_PAIRS`` pairs (a save of ~12 ms in a fresh
  process moves by a few ms from one process to the next; 6 pairs gave 0.99x-1.30x).

Moto's files (it spools objects over 5 MiB to its ``TMPDIR``) live on ``/dev/shm`` where
there is room, and each repetition's promoted copies are deleted after it: a real object
store does not write to the disk being measured. With moto's files on that disk, the save
that went first in a repetition shared it with the write-back of the promotions just made
(runs of 2026-12-05: tiered saves 0.35-0.41 s when first, 0.17-0.18 s when second).

Floors: save return with tiering <= 1.1x the local-only save, and the same for the first
save of a process; promotion >= 0.8x s3fs.

    python benchmarks/tiered.py            # ~256 MiB, 6 reps
    python benchmarks/tiered.py --quick    # 32 MiB, 2 reps (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks.common import (
    RESULTS,
    MiB,
    MotoProcess,
    machine_info,
    markdown_table,
    memory_base,
    scratch_dir,
    utc_timestamp,
    write_results,
)
from benchmarks.storage import moto_environment
from ckptstore.backends.s3 import S3Backend
from ckptstore.runtime.blocking import run
from ckptstore.testing.servers import MOTO_KEY, unique_bucket_name
from ckptstore.tiers.promote import promote_step

PACKAGES = ["ckptstore", "jax", "tensorstore", "numpy", "s3fs", "aiobotocore", "moto"]


def make_tree(total: int) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    rng = np.random.default_rng(0)
    rows = max(8, (total // 4) // (4 * 1024) // 8 * 8)
    big = {
        f"w{i}": jax.device_put(
            rng.standard_normal((rows, 1024), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
        )
        for i in range(4)
    }
    small = {f"b{i}": rng.standard_normal(1024).astype(np.float32) for i in range(50)}
    return {"params": big, "norms": small}


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_rep(
    rep: int,
    tree: Any,
    mgr: ckptstore.CheckpointManager,
    fs: Any,
    bucket: str,
    endpoint: str,
    scratch: Path,
    runs: dict[str, list[float]],
) -> None:
    """One repetition: local vs tiered save (then durable), promotion vs s3fs put."""
    local = str(scratch / f"local{rep}")

    def tiered_save() -> None:
        handle = mgr.save(rep, tree)
        assert handle is not None
        handle.wait()  # committed on the fast tier

    saves = [("local", lambda: ckptstore.save_sync(local, tree, step=rep)), ("tiered", tiered_save)]
    for name, fn in saves if rep % 2 else saves[::-1]:
        start = time.perf_counter()
        fn()
        runs[name].append(time.perf_counter() - start)
        if name == "tiered":
            mgr.wait_until_finished()  # promoted, committed on S3, keep policy applied
            runs["durable"].append(time.perf_counter() - start)

    fast = mgr.backend
    target = S3Backend(bucket, f"promote{rep}", endpoint_url=endpoint, credentials="env")

    async def promote() -> None:
        await promote_step(fast, target, rep)
        await target.close()

    def put() -> None:
        fs.put(str(scratch / "nvme" / str(rep)), f"{bucket}/s3fs{rep}/", recursive=True)

    pair = [("promote", lambda: mgr._call(promote())), ("s3fs", put)]
    for name, fn in pair if rep % 2 else pair[::-1]:
        runs[name].append(timed(fn))
    fs.rm([f"{bucket}/promote{rep}", f"{bucket}/s3fs{rep}"], recursive=True)  # moto's memory


#: Fresh-process pairs of the first-save comparison (each process costs ~3 s of start-up).
FIRST_SAVE_PAIRS = 16


def first_save_child(kind: str, endpoint: str, bucket: str, root: str) -> None:
    """In a fresh process: one untimed local save, then the timed first save to ``kind``
    (``local`` or ``tiered``); prints its seconds."""
    tree = {"w": np.ones((1024, 256), np.float32), "b": np.zeros(16, np.float32)}
    ckptstore.save_sync(os.path.join(root, "warm"), tree, step=0)
    target: Any = os.path.join(root, "local")
    if kind == "tiered":
        durable = S3Backend(bucket, root.strip("/"), endpoint_url=endpoint, credentials="env")
        target = ckptstore.Tiered(os.path.join(root, "fast"), durable)
    start = time.perf_counter()
    ckptstore.save_sync(target, tree, step=1)
    print(f"first-save {time.perf_counter() - start:.6f}")
    if kind == "tiered":  # the caller's backend: closed on the loop the save used
        run(durable.close())


def first_saves(reps: int, endpoint: str, bucket: str, scratch: Path) -> dict[str, list[float]]:
    """`first_save_child` for each kind, ``reps`` times, alternating which goes first."""
    import subprocess

    out: dict[str, list[float]] = {"first_local": [], "first_tiered": []}
    for rep in range(reps):
        for kind in ("local", "tiered") if rep % 2 == 0 else ("tiered", "local"):
            root = scratch / f"first-{kind}-{rep}"
            proc = subprocess.run(
                [sys.executable, __file__, "--first-save-child", kind, endpoint, bucket, str(root)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"first-save child failed: {proc.stderr[-2000:]}")
            out[f"first_{kind}"].append(float(proc.stdout.split("first-save ")[-1]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--no-write-results", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS / "tiered.json")
    parser.add_argument("--first-save-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_save_child:
        first_save_child(*args.first_save_child)
        return 0
    reps = args.reps or (2 if args.quick else 6)
    tree = make_tree((32 if args.quick else 256) * MiB)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    runs: dict[str, list[float]] = {
        k: [] for k in ("local", "tiered", "durable", "promote", "s3fs")
    }
    import s3fs

    with (
        scratch_dir("ckptstore-bench-tiered-") as scratch,
        scratch_dir("ckptstore-bench-moto-", memory_base()) as moto_tmp,
        moto_environment(),
    ):
        print(f"scratch directory: {scratch}; moto's files: {moto_tmp}")
        with MotoProcess(moto_tmp) as server:
            fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key=MOTO_KEY, secret=MOTO_KEY)
            bucket = unique_bucket_name("bench")
            fs.mkdir(bucket)
            durable = S3Backend(bucket, "run", endpoint_url=server.endpoint, credentials="env")
            tiered = ckptstore.Tiered(str(scratch / "nvme"), durable)
            opts = ckptstore.ManagerOptions(handle_sigterm=False, gc_on_start=False)
            keep = ckptstore.policies.KeepLatest(1)
            with ckptstore.CheckpointManager(tiered, keep_policy=keep, options=opts) as mgr:
                mgr.save(0, tree).wait()  # first-save costs untimed
                mgr.wait_until_finished()
                for rep in range(1, reps + 1):
                    one_rep(rep, tree, mgr, fs, bucket, server.endpoint, scratch, runs)
                    print(f"rep {rep}/{reps} done", flush=True)
            asyncio.run(durable.close())
            pairs = 1 if args.quick else FIRST_SAVE_PAIRS
            runs.update(first_saves(pairs, server.endpoint, bucket, scratch))

    med = {k: statistics.median(v) for k, v in runs.items()}
    rows, failed = [], []

    def row(
        what: str,
        value: float,
        base: str,
        base_value: float,
        ratio: float,
        floor: str,
        ok: bool | None,
    ) -> None:
        verdict = "info" if ok is None else ("PASS" if ok else "FAIL")
        if ok is False:
            failed.append(what)
        rows.append(
            [what, f"{value:.3f} s", base, f"{base_value:.3f} s", f"{ratio:.2f}x", floor, verdict]
        )

    r = med["tiered"] / med["local"]
    row(
        "save return (tiered)",
        med["tiered"],
        "local-only save",
        med["local"],
        r,
        "<= 1.1x",
        r <= 1.1,
    )
    r = med["first_tiered"] / med["first_local"]
    row(
        "first save of a process (tiered)",
        med["first_tiered"],
        "local-only first save",
        med["first_local"],
        r,
        "<= 1.1x",
        r <= 1.1,
    )
    r = med["s3fs"] / med["promote"]
    row("promotion", med["promote"], "s3fs put", med["s3fs"], r, ">= 0.8x", r >= 0.8)
    row(
        "save to durable (tiered)",
        med["durable"],
        "local-only save",
        med["local"],
        med["durable"] / med["local"],
        "-",
        None,
    )
    table = markdown_table(
        ["measure", "value", "baseline", "baseline value", "ratio", "floor", "verdict"], rows
    )
    print(f"\ntree {nbytes / MiB:.0f} MiB, {reps} reps, medians\n")
    print(table)
    print("\nruns (s):", {k: [round(x, 3) for x in v] for k, v in runs.items()})
    print("floors:", "all pass" if not failed else "FAILED: " + ", ".join(failed))
    if not args.no_write_results:
        write_results(
            args.output,
            {
                "benchmark": "tiered",
                "when": utc_timestamp(),
                "machine": machine_info(PACKAGES),
                "tree_bytes": nbytes,
                "reps": reps,
                "runs_s": runs,
                "medians_s": med,
                "table": table,
                "failed_floors": failed,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
