"""Partial-save benchmark: bytes written stay ~1.0x the payload, and time beats Orbax.

K parts (a dict of a few random-normal float32 leaves under a distinct key each) are
added to one step with `ckptstore.partial_save`, then finalized. Measured in one run:

- bytes, local disk: this process's ``write_bytes`` (``/proc/self/io``) over the K adds
  + finalize, and after each part (the curve); the files' total size after finalize.
  S3 (moto in a child process, smaller K): the bucket's total object size after each
  part and after finalize. Floors: <= 1.05x the payload; local curve linear in k
  (R^2 of a linear fit >= 0.999).
- snapshot-copy baseline (copy the whole checkpoint so far to a new snapshot on every
  partial save): full-scale curve computed from ckptstore's measured per-part bytes,
  validated by a real run (``shutil.copytree`` + fsync) at the same K with small parts.
- wall time vs Orbax 0.12.8 (``ocp.partial.save`` K times, ``ocp.partial.finalize``) on
  the same arrays, interleaved repetitions, medians; Orbax as-is and at equal durability
  (plus fsync of every file and directory it wrote: ckptstore fsyncs by default), with its
  default compression (zarr3, zstd level 3) and with it off (``orbax-nocomp``:
  ``ocp.Context`` with ``array.saving.use_compression = False``; ckptstore writes raw).
  Floor: Orbax-at-equal-durability median / ckptstore median >= 1.25.

    python benchmarks/partial.py            # K=50, 1 GiB local; S3 K=20 x 5 MiB; 5 reps
    python benchmarks/partial.py --quick    # tiny smoke run (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import (
    RESULTS,
    Baseline,
    Measurement,
    MiB,
    MotoProcess,
    Stats,
    interleave,
    machine_info,
    markdown_table,
    measurements_json,
    ratio,
    scratch_dir,
    sigterm_as_interrupt,
    utc_timestamp,
    verdict,
    write_results,
)

PACKAGES = ("ckptstore", "tensorstore", "jax", "numpy", "orbax-checkpoint", "boto3", "moto")
BYTES_FLOOR = 1.05  # bytes written / payload, at most
R2_FLOOR = 0.999  # linear fit of cumulative bytes vs k, at least
SPEED_FLOOR = 1.25  # Orbax (equal durability) median time / ckptstore median time, at least
LEAVES = 4  # leaves per part
SNAPSHOT_PART_MIB = 0.5  # part size of the real snapshot-copy run
HEADERS = ["metric", "value", "floor", "verdict"]
MOTO_KEY = "testing"  # moto's dummy credentials; not a secret

Tree = dict[str, dict[str, np.ndarray[Any, Any]]]


# ---- data and byte counters --------------------------------------------------------------


def make_parts(count: int, part_bytes: int, seed: int) -> list[Tree]:
    """``count`` parts ``{"part_<k>": {"w0": ..., ...}}`` of random-normal float32 leaves."""
    rng = np.random.default_rng(seed)
    shape = (max(1, part_bytes // LEAVES // 4 // 256), 256)
    return [
        {f"part_{k:03d}": {f"w{i}": rng.standard_normal(shape, np.float32) for i in range(LEAVES)}}
        for k in range(count)
    ]


def cumulative_payload(parts: list[Tree]) -> list[int]:
    sizes = [sum(a.nbytes for leaves in p.values() for a in leaves.values()) for p in parts]
    return [int(x) for x in np.cumsum(sizes)]


def proc_io() -> dict[str, int]:
    """This process's I/O counters (all threads), from ``/proc/self/io``."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


class WriteMeter:
    """``write_bytes`` and ``cancelled_write_bytes`` of this process since construction."""

    def __init__(self) -> None:
        self._start = proc_io()

    def __call__(self, counter: str = "write_bytes") -> int:
        return proc_io()[counter] - self._start[counter]


def tree_size(path: Path) -> tuple[int, int]:
    """(apparent size, allocated size) of every file under ``path``."""
    stats = [os.lstat(Path(top, f)) for top, _, files in os.walk(path) for f in files]
    return sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats)


def fsync_tree(path: Path) -> None:
    """fsync every file, then every directory (deepest first), under ``path``."""
    for top, _, files in os.walk(path, topdown=False):
        for name in [*files, "."]:
            fd = os.open(Path(top, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def linear_r2(ys: list[int]) -> float:
    """R^2 of the least-squares line through (k, ys[k-1]), k = 1..K."""
    if len(ys) < 3:
        return 1.0
    x, y = np.arange(1, len(ys) + 1, dtype=float), np.asarray(ys, dtype=float)
    fit = np.polyval(np.polyfit(x, y, 1), x)
    return float(1 - ((y - fit) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def snapshot_copy_curve(part_bytes: list[int]) -> list[int]:
    """Cumulative bytes of a design that rewrites every earlier part on each save."""
    return [int(x) for x in np.cumsum(np.cumsum(part_bytes))]


@dataclass
class Run:
    """K partial saves + finalize: time, cumulative bytes after each part, and totals."""

    seconds: float
    payload: list[int]  # cumulative payload after each part
    curve: list[int]  # cumulative bytes written after each part
    written: int  # after finalize (local: write_bytes; S3: object bytes)
    stored: int = 0  # local: files' apparent size; S3: object bytes
    allocated: int = 0  # local: allocated blocks; S3: object count
    cancelled: int = 0  # local: cancelled_write_bytes
    sync_seconds: float = 0.0  # Orbax: the fsync of its output (equal durability)
    part_bytes: list[int] = field(default_factory=list)  # snapshot run: each part's own bytes

    @property
    def ratio(self) -> float:
        return self.written / self.payload[-1]


# ---- contenders --------------------------------------------------------------------------


async def ckptstore_run(parts: list[Tree], root: Path) -> Run:
    """K `PartialSave.add` + `finalize` on a `LocalBackend` (fsync on, the default)."""
    import ckptstore
    from ckptstore.backends.local import LocalBackend

    meter, curve = WriteMeter(), []
    start = time.perf_counter()
    async with LocalBackend(root) as backend:
        session = await ckptstore.partial_save(backend, 1)
        for part in parts:
            await session.add(part)
            curve.append(meter())
        await session.finalize()
    seconds = time.perf_counter() - start
    size, alloc = tree_size(root)
    written, cancelled = meter(), meter("cancelled_write_bytes")
    return Run(seconds, cumulative_payload(parts), curve, written, size, alloc, cancelled)


def orbax_run(parts: list[Tree], root: Path, compress: bool = True) -> Run:
    """K ``ocp.partial.save`` + ``ocp.partial.finalize``, then (timed apart) fsync of it all;
    ``compress=False``: in a context with ``array.saving.use_compression = False``."""
    from orbax.checkpoint import v1 as ocp
    from orbax.checkpoint.experimental.v1 import partial

    path = root / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    context = ocp.Context()
    context.array_options.saving.use_compression = compress
    meter, curve = WriteMeter(), []
    start = time.perf_counter()
    with context:
        for part in parts:
            partial.save(path, part)
            curve.append(meter())
        partial.finalize(path)
    seconds = time.perf_counter() - start
    fsync_tree(path)
    synced = time.perf_counter() - start - seconds
    size, alloc = tree_size(root)
    written, cancelled = meter(), meter("cancelled_write_bytes")
    return Run(seconds, cumulative_payload(parts), curve, written, size, alloc, cancelled, synced)


def snapshot_copy_run(parts: list[Tree], root: Path) -> Run:
    """The baseline for real: copy the last snapshot, add the part, fsync, drop the old one."""
    meter, curve, own = WriteMeter(), [], []
    start = time.perf_counter()
    previous: Path | None = None
    for k, part in enumerate(parts):
        snap = root / f"snapshot_{k:03d}"
        shutil.copytree(previous, snap) if previous else snap.mkdir(parents=True)
        before = meter()
        for key, leaves in part.items():
            (snap / key).mkdir()
            for name, arr in leaves.items():
                np.save(snap / key / f"{name}.npy", arr)
        own.append(meter() - before)
        fsync_tree(snap)
        if previous:
            shutil.rmtree(previous)
        previous = snap
        curve.append(meter())
    seconds = time.perf_counter() - start
    return Run(seconds, cumulative_payload(parts), curve, meter(), part_bytes=own)


async def s3_run(parts: list[Tree], scratch: Path) -> Run:
    """K adds + finalize on moto S3; bytes = total size of the bucket's objects."""
    import boto3

    import ckptstore
    from ckptstore.backends.s3 import S3Backend
    from ckptstore.testing.servers import unique_bucket_name

    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    env = {**dict.fromkeys(keys, MOTO_KEY), "AWS_DEFAULT_REGION": "us-east-1"}
    with MotoProcess(scratch / "moto-tmp") as server, mock.patch.dict(os.environ, env):
        os.environ.pop("AWS_PROFILE", None)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        client = boto3.client("s3", endpoint_url=server.endpoint)
        bucket = unique_bucket_name("bench")
        client.create_bucket(Bucket=bucket)  # no region: moto rejects us-east-1 as a constraint

        def stored() -> tuple[int, int]:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            sizes = [obj["Size"] for page in pages for obj in page.get("Contents", [])]
            return sum(sizes), len(sizes)

        curve, seconds = [], 0.0
        try:
            backend = S3Backend(bucket, "ckpt", endpoint_url=server.endpoint, credentials="env")
            async with backend as b:
                start = time.perf_counter()
                session = await ckptstore.partial_save(b, 1)
                for part in parts:
                    await session.add(part)
                    seconds += time.perf_counter() - start
                    curve.append(stored()[0])  # listing: not timed
                    start = time.perf_counter()
                await session.finalize()
                seconds += time.perf_counter() - start
            total, count = stored()
        finally:
            client.close()
    return Run(seconds, cumulative_payload(parts), curve, total, total, count)


# ---- driver ------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Every measurement: {"ckptstore", "orbax": [Run per rep], "snapshot", "s3": Run}."""
    parts = make_parts(args.parts, int(args.total_mib * MiB / args.parts), args.seed)
    total = cumulative_payload(parts)[-1]
    print(f"local: K={args.parts}, {total / MiB:.0f} MiB, {args.reps} reps (interleaved) ...")
    runs: dict[str, list[Run]] = {"ckptstore": [], "orbax": [], "orbax-nocomp": []}

    def runner(name: str, fn: Callable[[list[Tree], Path], Awaitable[Run]]) -> Any:
        async def run() -> float:
            os.sync()  # untimed: no dirty pages left by the previous run
            try:
                runs[name].append(r := await fn(parts, scratch / name))
            finally:
                shutil.rmtree(scratch / name, ignore_errors=True)
            return r.seconds + r.sync_seconds

        return run

    async def orbax(parts: list[Tree], root: Path) -> Run:
        return await asyncio.to_thread(orbax_run, parts, root)

    async def orbax_nocomp(parts: list[Tree], root: Path) -> Run:
        return await asyncio.to_thread(orbax_run, parts, root, False)

    contenders = {"ckptstore": ckptstore_run, "orbax": orbax, "orbax-nocomp": orbax_nocomp}
    for name, fn in contenders.items():  # untimed warm-up: imports, first-call set-up
        await fn(parts[:2], scratch / f"warmup-{name}")
        shutil.rmtree(scratch / f"warmup-{name}")
    await interleave(args.reps, [runner(name, fn) for name, fn in contenders.items()])

    small = make_parts(args.parts, int(args.snapshot_part_mib * MiB), args.seed + 1)
    print(f"snapshot-copy baseline, real run: K={args.parts} x {args.snapshot_part_mib} MiB ...")
    os.sync()
    try:
        snapshot = snapshot_copy_run(small, scratch / "snapshot")
    finally:
        shutil.rmtree(scratch / "snapshot", ignore_errors=True)

    print(f"s3 (moto): K={args.s3_parts} x {args.s3_part_mib} MiB ...", flush=True)
    s3parts = make_parts(args.s3_parts, int(args.s3_part_mib * MiB), args.seed + 2)
    s3 = await s3_run(s3parts, scratch)
    return {**runs, "snapshot": snapshot, "s3": s3}


def summarize(runs: dict[str, Any]) -> tuple[Measurement, dict[str, Any]]:
    """The timing comparison and every derived figure (ratios, fits, analytic curves)."""
    ck, ob, snap, s3 = runs["ckptstore"], runs["orbax"], runs["snapshot"], runs["s3"]
    off = runs["orbax-nocomp"]
    payload = ck[0].payload
    op, synced = (
        f"{len(payload)} partial saves + finalize",
        [r.seconds + r.sync_seconds for r in ob],
    )
    timing = Measurement("local", op, payload[-1], "ckptstore", Stats([r.seconds for r in ck]))
    timing.baselines = [
        Baseline("Orbax + fsync", Stats(synced), SPEED_FLOOR),
        Baseline("Orbax as-is", Stats([r.seconds for r in ob])),
        Baseline("Orbax uncompressed + fsync", Stats([r.seconds + r.sync_seconds for r in off])),
    ]
    per_part = np.diff([0, *ck[0].curve]).tolist()  # ckptstore's own bytes for each part
    analytic = snapshot_copy_curve(per_part)
    predicted = snapshot_copy_curve(snap.part_bytes)

    def median(xs: list[float]) -> float:
        return float(np.median(xs))

    figures = {
        "payload_bytes": payload[-1],
        "ckptstore_write_ratio": median([r.ratio for r in ck]),
        "ckptstore_files_ratio": median([r.stored / payload[-1] for r in ck]),
        "ckptstore_allocated_ratio": median([r.allocated / payload[-1] for r in ck]),
        "ckptstore_r2_linear_worst": min(linear_r2(r.curve) for r in ck),
        "ckptstore_max_ratio_over_k": max(max(np.divide(r.curve, payload)) for r in ck),
        "ckptstore_ratio_first_part": median([r.curve[0] / payload[0] for r in ck]),
        "orbax_write_ratio": median([r.ratio for r in ob]),
        "orbax_files_ratio": median([r.stored / payload[-1] for r in ob]),
        "orbax_fsync_s_median": median([r.sync_seconds for r in ob]),
        "orbax_nocomp_write_ratio": median([r.ratio for r in off]),
        "snapshot_copy_analytic_curve": analytic,
        "snapshot_copy_analytic_ratio": analytic[-1] / payload[-1],
        "snapshot_copy_real_predicted_curve": predicted,
        "snapshot_copy_real_measured_over_predicted": snap.written / predicted[-1],
        "snapshot_copy_real_ratio": snap.ratio,
        "s3_ratio": s3.ratio,
        "s3_objects": s3.allocated,
        "s3_r2_linear": linear_r2(s3.curve),
    }
    return timing, figures


def table(timing: Measurement, fig: dict[str, Any], s3: Run) -> list[list[str]]:
    """metric | value | floor | verdict: byte floors, time floor, informational figures."""
    rows: list[list[str]] = []

    def row(metric: str, value: str, floor: str = "-", ok: bool | None = None) -> None:
        rows.append([metric, value, floor, "info" if ok is None else ("PASS" if ok else "FAIL")])

    def at_most(metric: str, value: float) -> None:
        row(metric, f"{value:.4f}x", f"<= {BYTES_FLOOR}x", value <= BYTES_FLOOR)

    at_most("local write_bytes / payload", fig["ckptstore_write_ratio"])
    at_most("local files' size / payload", fig["ckptstore_files_ratio"])
    at_most(f"S3 object bytes / payload (K={len(s3.curve)})", fig["s3_ratio"])
    r2 = fig["ckptstore_r2_linear_worst"]
    row("local bytes(k): R^2 of linear fit", f"{r2:.6f}", f">= {R2_FLOOR}", r2 >= R2_FLOOR)
    for b in timing.baselines:
        value = f"{ratio(timing, b):.2f}x ({b.stats.median:.2f} s / {timing.stats.median:.2f} s)"
        floor = "-" if b.floor is None else f">= {b.floor}x"
        ok = {"PASS": True, "FAIL": False}.get(verdict(timing, b))
        row(f"time: {b.name} / ckptstore", value, floor, ok)
    row("local max over k of bytes(k)/payload(k)", f"{fig['ckptstore_max_ratio_over_k']:.4f}x")
    row("local allocated blocks / payload", f"{fig['ckptstore_allocated_ratio']:.4f}x")
    row("Orbax write_bytes / payload (zstd)", f"{fig['orbax_write_ratio']:.4f}x")
    row("Orbax uncompressed write_bytes / payload", f"{fig['orbax_nocomp_write_ratio']:.4f}x")
    row("snapshot-copy / payload (analytic)", f"{fig['snapshot_copy_analytic_ratio']:.2f}x")
    check = fig["snapshot_copy_real_measured_over_predicted"]
    row("snapshot-copy real run: measured/predicted", f"{check:.4f}")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--parts", type=int, default=50, help="K partial saves on local disk (default 50)")
    add("--total-mib", type=float, default=1024, help="local payload, MiB (default 1024)")
    add("--reps", type=int, default=5, help="timed repetitions (default 5)")
    add("--s3-parts", type=int, default=20, help="K on moto S3 (default 20)")
    add("--s3-part-mib", type=float, default=5, help="part size on S3, MiB (default 5)")
    add("--quick", action="store_true", help="smoke run: K=4 x 2 MiB, 1 rep; S3 K=3 x 1 MiB")
    add("--scratch", type=Path, default=None, help="parent of the temporary directory")
    add("--no-write-results", action="store_true", help="write neither the JSON nor the plots")
    add("--strict", action="store_true", help="exit 1 if any floor fails")
    add("--seed", type=int, default=0, help="seed of the random payload")
    args = p.parse_args(argv)
    args.snapshot_part_mib = SNAPSHOT_PART_MIB
    if args.quick:
        args.parts, args.total_mib, args.reps, args.s3_parts, args.s3_part_mib = 4, 8, 1, 3, 1
    if min(args.parts, args.reps, args.s3_parts) < 1 or min(args.total_mib, args.s3_part_mib) <= 0:
        p.error("sizes and counts must be positive")
    return args


def results_json(
    args: argparse.Namespace,
    machine: dict[str, Any],
    runs: dict[str, Any],
    timing: Measurement,
    fig: dict[str, Any],
    rows: list[list[str]],
) -> dict[str, Any]:
    """Timestamp, machine, parameters, the table, raw runs, medians and ratios."""
    config = {k: v for k, v in vars(args).items() if k not in ("scratch", "no_write_results")}
    return {
        "benchmark": "partial",
        "timestamp": utc_timestamp(),
        "command": " ".join(["python", "benchmarks/partial.py", *sys.argv[1:]]),
        "config": {
            **config,
            "leaves_per_part": LEAVES,
            "floors": {"bytes_max": BYTES_FLOOR, "r2_min": R2_FLOOR, "speed_min": SPEED_FLOOR},
            "speed_floor_against": "Orbax + fsync of all it wrote (equal durability)",
            "order": "ckptstore, Orbax and Orbax uncompressed interleaved, first one rotating",
            "snapshot_copy": "analytic at full scale from ckptstore's per-part write_bytes; "
            "validated by a real copytree run with small parts",
        },
        "machine": machine,
        "table": [dict(zip(HEADERS, r, strict=True)) for r in rows],
        "timing": measurements_json([timing]),
        "figures": fig,
        "runs": {
            k: [asdict(r) for r in v] if k in ("ckptstore", "orbax", "orbax-nocomp") else asdict(v)
            for k, v in runs.items()
        },
        "all_floors_pass": all(r[3] != "FAIL" for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("absl", "orbax", "jax"):  # Orbax logs every partial save
        logging.getLogger(name).setLevel(logging.ERROR)
    with sigterm_as_interrupt(), scratch_dir("ckptstore-bench-partial-", args.scratch) as scratch:
        print(f"scratch directory: {scratch}", flush=True)
        machine = machine_info([*PACKAGES, "matplotlib"], scratch)
        runs = asyncio.run(bench(args, scratch))
    timing, fig = summarize(runs)
    rows = table(timing, fig, runs["s3"])
    failed = [r[0] for r in rows if r[3] == "FAIL"]
    print("\n" + markdown_table(HEADERS, rows))
    print("\nfloors: " + ("all PASS" if not failed else "FAIL: " + "; ".join(failed)))
    if not args.no_write_results:
        from benchmarks import report  # matplotlib: only where plots are drawn

        json_path = RESULTS / "partial.json"
        write_results(json_path, results_json(args, machine, runs, timing, fig, rows))
        pngs = report.render(["partial_bytes.png", "partial_orbax.png"])
        print(f"results written to {json_path}; plots: {', '.join(map(str, pngs))}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
