"""Scale benchmark: what a save's merge, commit, manifest and coordination cost against the
number of processes P, without P machines.

P processes are simulated in this one OS process: each simulated process i of P runs the
real `ckptstore.save` (every hand-off, write, merge and commit of
`ckptstore.checkpoint.save`) on its own backend, as an asyncio task. The simulation
replaces only what `ckptstore.runtime.distributed` asks jax for, while it runs (see
`benchmarks/simulated.py`): the process index (a context variable each task sets), the process count
(P), the collective-name counter (kept per simulated process, as each real process keeps
its own) and the coordination key-value store (an in-memory one with the same
semantics: a get waits for its key). Nothing in the package is changed or mocked below
that line: writes, merge, validation and commit go to local disk or to moto's S3
server over real HTTP.

Each simulated process's share of the tree is tiny (the point is metadata and commit
cost): ``SHARDED`` leaves of shape (P * ROWS, COLS) float32, sharded over all P processes
along the first dimension (each process writes one 256-byte chunk of each), plus
``SMALL`` replicated leaves that process 0 writes (in packs, as saves do). The shards
are `HostShards`, as a staged save passes them, over a `NamedSharding` on P CPU devices
(``--xla_force_host_platform_device_count``), so the manifest records what a real job's
would.

Non-zero processes write one after another (process 0 first), each until it has
published its report, so requests can be counted per process: calls of the `Backend`
byte API (a counting wrapper) plus TensorStore's own kvstore requests (its metrics,
read before and after each process's turn). Then process 0 merges and commits while
the others wait for its outcome, as in a real job; its merge and commit seconds are
the save's own ``timings``.

Reported against P: process 0's merge and commit seconds, manifest and merged-index
bytes, requests of process 0 and of every other process, key-value messages, and
objects per key prefix; every step is then restored and compared bit-exact. Floors
(local disk): at P = 1,024, merge + commit <= 5 s; from P = 64 to 1,024, merge + commit
grows at most linearly (<= 16x); on both backends, the key-value messages of every
non-zero process are the same at every P and its requests stay under a bound that does
not depend on P (`OTHER_REQUESTS_BOUND`).

    python benchmarks/scale.py                  # P = 8 ... 4,096 local; 8 ... 1,024 on moto S3
    python benchmarks/scale.py --quick          # P = 4, 8, local disk only (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    REPO,
    RESULTS,
    MotoProcess,
    machine_info,
    markdown_table,
    scratch_dir,
    sigterm_as_interrupt,
    utc_timestamp,
    write_results,
)
from benchmarks.simulated import PROCESS, Simulated, counting_backend, ts_requests

PACKAGES = ("ckptstore", "tensorstore", "jax", "numpy", "boto3", "moto")
LOCAL_PS = (8, 16, 64, 256, 1024, 4096)
S3_PS = (8, 16, 64, 256, 1024)
SHARDED, SMALL = 4, 8  # leaves sharded over every process; replicated leaves (process 0)
ROWS, COLS = 4, 16  # each process's chunk of a sharded leaf: 4 x 16 float32 = 256 bytes
MERGE_COMMIT_FLOOR = 5.0  # seconds, at P = FLOOR_AT on local disk
FLOOR_AT = 1024
GROWTH_FROM = 64  # merge + commit grows at most linearly from this P to FLOOR_AT
MOTO_KEY = "testing"  # moto's dummy credentials; not a secret
PLOT = REPO / "docs" / "img" / "scale.png"
#: The most requests a non-zero process can make, whatever P is: its `exists` check, then
#: for the first OCDBT commit of its store a manifest read and 3 writes (data file, B-tree
#: node, manifest), for each further commit a read and 2 writes. Its leaves' writes land
#: in one commit, or in up to one each when they reach OCDBT apart (timing, not P,
#: decides: 5, 8, 11 or 14 requests with 4 leaves).
OTHER_REQUESTS_BOUND = 1 + 4 + 3 * (SHARDED - 1)

log = logging.getLogger("ckptstore.bench.scale")


def tree_of(process: int, count: int, devices: list[Any]) -> dict[str, Any]:
    """Process ``process``'s view of the saved tree: its one shard of each sharded leaf
    (staged, as `HostShards`) and the replicated leaves (numpy; written by process 0)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ckptstore.format.leaves import HostShards

    sharding = NamedSharding(Mesh(np.array(devices[:count]), ("p",)), P("p"))
    rows = slice(process * ROWS, (process + 1) * ROWS)
    tree: dict[str, Any] = {}
    for k in range(SHARDED):
        piece = expected_sharded(k, count)[rows]
        tree[f"layer{k}"] = HostShards(
            shape=(count * ROWS, COLS),
            dtype=np.dtype(np.float32),
            sharding=sharding,
            pieces=(((rows, slice(0, COLS)), piece),),
        )
    for k in range(SMALL):
        tree[f"small{k}"] = expected_small(k)
    return tree


def expected_sharded(k: int, count: int) -> Any:
    import numpy as np

    return (np.arange(count * ROWS * COLS, dtype=np.float32) * (k + 1)).reshape(-1, COLS)


def expected_small(k: int) -> Any:
    import numpy as np

    return np.full(COLS, k + 0.5, dtype=np.float32)


# ---- one run at one P --------------------------------------------------------------------


@dataclass
class ProcessCost:
    """What one simulated process asked of the storage and of the key-value store."""

    backend: Counter[str] = field(default_factory=Counter)  # byte-API calls by operation
    ts: Counter[str] = field(default_factory=Counter)  # TensorStore kvstore requests

    @property
    def requests(self) -> int:
        return sum(self.backend.values()) + sum(self.ts.values())


async def run_at(
    count: int, make_backend: Callable[[], Any], devices: list[Any], timeout: float
) -> dict[str, Any]:
    """Save step 1 as P = ``count`` simulated processes; measure; check it restores."""
    import ckptstore

    costs = [ProcessCost() for _ in range(count)]
    p0_merge = ProcessCost()  # process 0's requests after every report is in
    results: dict[int, Any] = {}

    async def process(i: int) -> None:
        PROCESS.set(i)
        async with make_backend() as inner:
            backend = counting_backend(inner, costs[i].backend)
            results[i] = await ckptstore.save(
                backend, tree_of(i, count, devices), step=1, timeout=timeout
            )

    async def turn(i: int) -> asyncio.Task[None]:
        """Run process ``i`` until it has published its report (its writes are done)."""
        before = ts_requests()
        task = asyncio.create_task(process(i))
        reported = asyncio.create_task(sim.kv.reported[i].wait())
        await asyncio.wait({task, reported}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # failed (or, with one process, finished) before reporting
            reported.cancel()
            task.result()
        costs[i].ts = ts_requests() - before
        return task

    start = time.perf_counter()
    with Simulated(count) as sim:
        tasks = [await turn(i) for i in range(count)]
        writes = time.perf_counter() - start
        before, p0_backend = ts_requests(), Counter(costs[0].backend)
        await tasks[0]  # process 0: reads the reports, merges, commits, publishes
        p0_merge.ts = ts_requests() - before
        p0_merge.backend = costs[0].backend - p0_backend
        costs[0].ts += p0_merge.ts
        await asyncio.gather(*tasks[1:])
        kv = sim.kv
    wall = time.perf_counter() - start
    result = results[0]
    # The save's "merge" phase starts when process 0's own writes end, so it includes the
    # wait for every other process's report (here they wrote one after another). Process
    # 0's merge is what follows its read of the last report, up to its published outcome.
    commit = result.timings["commit"]
    merge = kv.last_set[0] - kv.last_get[0] - commit

    async with make_backend() as backend:  # uncounted: the figures of what was written
        layout = await stored(backend, result.attempt)
        restored = await ckptstore.restore(backend, step=1)
    exact = all(
        restored[f"layer{k}"].tobytes() == expected_sharded(k, count).tobytes()
        for k in range(SHARDED)
    ) and all(restored[f"small{k}"].tobytes() == expected_small(k).tobytes() for k in range(SMALL))

    others = costs[1:]
    return {
        "processes": count,
        "seconds": {
            "merge": round(merge, 4),
            "commit": round(commit, 4),
            "merge_plus_commit": round(merge + commit, 4),
            "writes_all_processes_one_by_one": round(writes, 3),
            "wall": round(wall, 3),
        },
        **layout,
        "requests": {
            "process_0": {
                "total": costs[0].requests,
                "merge_and_commit": p0_merge.requests,
                "merge_and_commit_backend": dict(p0_merge.backend),
                "merge_and_commit_tensorstore": dict(p0_merge.ts),
            },
            "other_processes": spread([c.requests for c in others]),
            "other_process_1": {"backend": dict(costs[1].backend), "tensorstore": dict(costs[1].ts)}
            if others
            else None,
            "all_processes": sum(c.requests for c in costs),
        },
        "kv_messages": {
            "process_0": {"set": kv.sets[0], "get": kv.gets[0], "bytes": kv.bytes[0]},
            "other_processes": {
                "set": spread([kv.sets[i] for i in range(1, count)]),
                "get": spread([kv.gets[i] for i in range(1, count)]),
                "bytes": spread([kv.bytes[i] for i in range(1, count)]),
            },
            "total": sum(kv.sets.values()) + sum(kv.gets.values()),
        },
        "restored_bit_exact": exact,
    }


def spread(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


async def stored(backend: Any, attempt: str) -> dict[str, Any]:
    """Bytes of the manifest and the merged index, and objects per key prefix."""
    objects = [info async for info in backend.list("")]
    per_prefix = Counter(info.key.rsplit("/", 1)[0] if "/" in info.key else "" for info in objects)
    item = f"1/{attempt}/state/"
    merged = [
        info
        for info in objects
        if info.key.startswith(item) and not info.key[len(item) :].startswith("ocdbt.process_")
    ]
    index = [info for info in merged if "/packs/" not in f"/{info.key}"]
    manifest = next(info.size for info in objects if info.key == f"1/{attempt}/manifest.json")
    process_1 = [info for info in objects if info.key.startswith(f"{item}ocdbt.process_1/")]
    biggest = per_prefix.most_common(1)[0]
    return {
        "bytes": {
            "manifest": manifest,
            "merged_index": sum(info.size for info in index),
            "marker": next(info.size for info in objects if info.key == "1/COMMITTED"),
            "all_objects": sum(info.size for info in objects),
        },
        "objects": {
            "total": len(objects),
            "prefixes": len(per_prefix),
            "max_in_one_prefix": biggest[1],
            "max_prefix": biggest[0].replace(attempt, "<attempt>"),
            "merged_index": len(index),
            "per_other_process_store": len(process_1),
            "directly_below_item": len(
                {
                    info.key[len(item) :].split("/")[0]
                    for info in objects
                    if info.key.startswith(item)
                }
            ),
        },
    }


# ---- driver, floors, report ----------------------------------------------------------------


def local_backends(scratch: Path) -> Iterator[Callable[[], Any]]:
    from ckptstore.backends.local import LocalBackend

    n = 0
    while True:
        n += 1
        root = scratch / f"local-{n}"
        yield lambda root=root: LocalBackend(root)


async def bench(
    args: argparse.Namespace, scratch: Path, devices: list[Any]
) -> dict[str, list[dict[str, Any]]]:
    from ckptstore.backends.s3 import S3Backend
    from ckptstore.testing.servers import unique_bucket_name

    out: dict[str, list[dict[str, Any]]] = {"local": [], "s3": []}
    roots = local_backends(scratch)
    for count in args.local:
        print(f"local disk, P = {count} ...", flush=True)
        row = await run_at(count, next(roots), devices, args.timeout)
        out["local"].append(row)
        print(summary_line(row), flush=True)
    if not args.s3:
        return out
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    env = {**dict.fromkeys(keys, MOTO_KEY), "AWS_DEFAULT_REGION": "us-east-1"}
    # Simulated processes share one aiobotocore session (each still has its own client,
    # connections and TensorStore context): a session's set-up costs ~0.3 s, which a real
    # process pays once at start whatever P is, and which would dominate the run here.
    sessions: list[Any] = []
    own_session = S3Backend._session

    def shared_session(self: S3Backend) -> Any:
        if not sessions:
            sessions.append(own_session(self))
        return sessions[0]

    with (
        MotoProcess(scratch / "moto-tmp") as server,
        mock.patch.dict(os.environ, env),
        mock.patch.object(S3Backend, "_session", shared_session),
    ):
        os.environ.pop("AWS_PROFILE", None)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        import boto3

        client = boto3.client("s3", endpoint_url=server.endpoint)
        try:
            for count in args.s3:
                bucket = unique_bucket_name("scale")
                client.create_bucket(Bucket=bucket)
                print(f"moto S3, P = {count} ...", flush=True)

                def make(bucket: str = bucket) -> Any:
                    return S3Backend(
                        bucket, "ckpt", endpoint_url=server.endpoint, credentials="env"
                    )

                row = await run_at(count, make, devices, args.timeout)
                out["s3"].append(row)
                print(summary_line(row), flush=True)
        finally:
            client.close()
    return out


def summary_line(row: dict[str, Any]) -> str:
    s, r, b = row["seconds"], row["requests"], row["bytes"]
    return (
        f"  merge {s['merge']:.3f} s, commit {s['commit']:.3f} s; manifest {b['manifest']:,} B, "
        f"index {b['merged_index']:,} B; requests p0 {r['process_0']['total']}, others "
        f"{r['other_processes'].get('max', '-')}; "
        f"all writes {s['writes_all_processes_one_by_one']:.1f} s"
    )


def floors(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each floor: what it asks, the measured value, and whether it holds."""
    out: list[dict[str, Any]] = []
    local = {row["processes"]: row for row in runs["local"]}
    big = FLOOR_AT if FLOOR_AT in local else None
    if big is not None:
        mc = local[big]["seconds"]["merge_plus_commit"]
        out.append(
            {
                "floor": f"local P={big}: merge + commit <= {MERGE_COMMIT_FLOOR:g} s",
                "value": f"{mc:.3f} s",
                "pass": mc <= MERGE_COMMIT_FLOOR,
            }
        )
    if GROWTH_FROM in local and big is not None:
        a, b = (local[p]["seconds"]["merge_plus_commit"] for p in (GROWTH_FROM, big))
        growth, linear = b / a, big / GROWTH_FROM
        out.append(
            {
                "floor": f"local P={GROWTH_FROM} -> {big}: merge + commit grows <= {linear:g}x",
                "value": f"{growth:.2f}x",
                "pass": growth <= linear,
            }
        )
    for name, rows in runs.items():
        if len(rows) < 2:
            continue
        per = {row["processes"]: row for row in rows}
        reqs = {p: row["requests"]["other_processes"] for p, row in per.items()}
        msgs = {
            p: tuple(row["kv_messages"]["other_processes"][k]["max"] for k in ("set", "get"))
            for p, row in per.items()
        }
        # The median process: how a process's writes group into OCDBT commits is timing (the
        # constant's comment), and under load one process of eight counted 15; P sets neither.
        bounded = all(r["median"] <= OTHER_REQUESTS_BOUND for r in reqs.values())
        out.append(
            {
                "floor": f"{name}: requests of the median non-zero process never above "
                f"{OTHER_REQUESTS_BOUND} (one OCDBT commit per leaf), whatever P",
                "value": ", ".join(
                    f"P={p}: median {r['median']:g} ({r['min']}-{r['max']})"
                    for p, r in reqs.items()
                ),
                "pass": bounded,
            }
        )
        same_msgs = len(set(msgs.values())) == 1
        out.append(
            {
                "floor": f"{name}: KV messages (set, get) of a non-zero process: same at every P",
                "value": ", ".join(f"P={p}: {v}" for p, v in msgs.items()),
                "pass": same_msgs,
            }
        )
        exact = all(row["restored_bit_exact"] for row in rows)
        out.append(
            {"floor": f"{name}: every step restores bit-exact", "value": str(exact), "pass": exact}
        )
    return out


HEADERS = [
    "backend",
    "P",
    "merge s",
    "commit s",
    "manifest B",
    "index B",
    "p0 requests (merge+commit)",
    "requests / other process: median (max)",
    "KV msgs p0 (set/get)",
    "KV msgs / other",
    "objects",
    "entries below <item>/",
]


def rows_of(runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for name, results in runs.items():
        for row in results:
            s, b, r, kv, o = (
                row["seconds"],
                row["bytes"],
                row["requests"],
                row["kv_messages"],
                row["objects"],
            )
            other = r["other_processes"]
            kv_o = kv["other_processes"]
            rows.append(
                [
                    name,
                    f"{row['processes']:,}",
                    f"{s['merge']:.3f}",
                    f"{s['commit']:.3f}",
                    f"{b['manifest']:,}",
                    f"{b['merged_index']:,}",
                    f"{r['process_0']['total']:,} ({r['process_0']['merge_and_commit']:,})",
                    f"{other['median']:g} ({other['max']})" if other else "-",
                    f"{kv['process_0']['set']}/{kv['process_0']['get']:,}",
                    f"{kv_o['set']['max']}/{kv_o['get']['max']}" if kv_o["set"] else "-",
                    f"{o['total']:,}",
                    f"{o['directly_below_item']:,}",
                ]
            )
    return rows


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """`figure_of` ``runs``, saved to ``path``."""
    import matplotlib.pyplot as plt

    figure = figure_of(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)


def figure_of(runs: dict[str, list[dict[str, Any]]]) -> Any:
    """Left: process 0's merge and commit seconds vs P (log-log, with a linear guide);
    right: manifest and index bytes, and process 0's requests vs P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"local": ("tab:blue", "o"), "s3": ("tab:purple", "s")}
    for name, rows in runs.items():
        if not rows:
            continue
        color, marker = styles[name]
        ps = [row["processes"] for row in rows]
        label = "local disk" if name == "local" else "moto S3"
        for key, ls in (("merge", "-"), ("commit", "--")):
            left.plot(
                ps,
                [row["seconds"][key] for row in rows],
                ls,
                marker=marker,
                color=color,
                label=f"{label}: {key}",
            )
        right.plot(
            ps,
            [row["bytes"]["manifest"] for row in rows],
            "-",
            marker=marker,
            color=color,
            label=f"{label}: manifest bytes",
        )
        right.plot(
            ps,
            [row["bytes"]["merged_index"] for row in rows],
            "--",
            marker=marker,
            color=color,
            label=f"{label}: merged index bytes",
        )
        right.plot(
            ps,
            [row["requests"]["process_0"]["total"] for row in rows],
            ":",
            marker=marker,
            color=color,
            label=f"{label}: process 0 requests",
        )
    local = runs.get("local") or []
    if local:
        ps = [row["processes"] for row in local]
        base = next((row for row in local if row["processes"] >= GROWTH_FROM), local[0])
        guide = [base["seconds"]["merge_plus_commit"] * p / base["processes"] for p in ps]
        left.plot(
            ps, guide, color="gray", lw=0.8, ls=":", label="linear from P=64 (merge + commit)"
        )
        left.axhline(
            MERGE_COMMIT_FLOOR,
            color="black",
            lw=0.8,
            ls="-.",
            label=f"floor {MERGE_COMMIT_FLOOR:g} s at P=1,024",
        )
    left.set(
        xscale="log",
        yscale="log",
        xlabel="processes P",
        ylabel="seconds (process 0)",
        title="Merge and commit vs process count",
    )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="processes P",
        title="Metadata and requests vs process count",
    )
    for ax in (left, right):
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    return figure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--local", type=int, nargs="*", default=list(LOCAL_PS), help="P values on local disk")
    add("--s3", type=int, nargs="*", default=list(S3_PS), help="P values on moto S3 (none: skip)")
    add("--quick", action="store_true", help="smoke run: P = 4, 8 on local disk only")
    add("--timeout", type=float, default=600.0, help="coordination timeout, s")
    add("--scratch", type=Path, default=None, help="parent of the temporary directory")
    add("--no-write-results", action="store_true", help="write neither the JSON nor the plot")
    add("--strict", action="store_true", help="exit 1 if any floor fails")
    add("--from-json", type=Path, default=None, help="report (and replot) a run's results file")
    args = p.parse_args(argv)
    if args.quick:
        args.local, args.s3 = [4, 8], []
    if any(n < 1 for n in [*args.local, *args.s3]):
        p.error("process counts must be >= 1")
    return args


def report(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Print the table and the floors; the floors' verdicts."""
    checks = floors(runs)
    print("\n" + markdown_table(HEADERS, rows_of(runs)))
    verdicts = [[c["floor"], c["value"], "PASS" if c["pass"] else "FAIL"] for c in checks]
    print("\n" + markdown_table(["floor", "value", "verdict"], verdicts))
    failed = [c["floor"] for c in checks if not c["pass"]]
    print("\nfloors: " + ("all PASS" if not failed else "FAIL: " + "; ".join(failed)))
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:  # the table, floors and plot again, from a run's results
        payload = json.loads(args.from_json.read_text())
        payload["floors"] = checks = report(payload["runs"])
        payload["all_floors_pass"] = all(c["pass"] for c in checks)
        if not args.no_write_results:
            write_results(args.from_json, payload)
            plot(payload["runs"], PLOT)
        return 1 if args.strict and not payload["all_floors_pass"] else 0
    most = max([*args.local, *args.s3, 1])
    os.environ["XLA_FLAGS"] = (  # before jax starts: one CPU device per simulated process
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={most}"
    ).strip()
    import jax

    logging.getLogger("ckptstore").setLevel(logging.WARNING)
    devices = jax.devices()
    with sigterm_as_interrupt(), scratch_dir("ckptstore-bench-scale-", args.scratch) as scratch:
        print(f"scratch directory: {scratch}", flush=True)
        machine = machine_info([*PACKAGES, "matplotlib"], scratch)
        runs = asyncio.run(bench(args, scratch, devices))
    checks = report(runs)
    failed = [c["floor"] for c in checks if not c["pass"]]
    if not args.no_write_results:
        payload = {
            "benchmark": "scale",
            "timestamp": utc_timestamp(),
            "command": " ".join(["python", "benchmarks/scale.py", *sys.argv[1:]]),
            "config": {
                "local_processes": args.local,
                "s3_processes": args.s3,
                "sharded_leaves": SHARDED,
                "replicated_leaves": SMALL,
                "chunk_per_process_bytes": ROWS * COLS * 4,
                "simulation": "one OS process; each simulated process runs ckptstore.save as an "
                "asyncio task with its own backend; ckptstore.runtime.distributed's process "
                "index/count, name counter and key-value store are simulated",
                "order": "process 0 writes first, then each other process in turn until it "
                "reports; then process 0 merges and commits while the others wait",
            },
            "machine": machine,
            "runs": runs,
            "floors": checks,
            "all_floors_pass": not failed,
        }
        write_results(RESULTS / "scale.json", payload)
        plot(runs, PLOT)
        print(f"results written to {RESULTS / 'scale.json'} and {PLOT}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
