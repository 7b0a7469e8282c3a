"""Object-store data path on the emulators: byte reads and TensorStore's settings.

- reads: `S3Backend.read` / `GcsBackend.read` of one large object as a single GET
  (``read_part_size`` above the object's size) vs parallel ranged GETs of several
  part sizes and concurrencies, all reading the same object on one server.
- tensorstore: ``ckptstore.save`` + ``restore`` (to numpy) of a tree through
  TensorStore's s3 / gcs kvstore drivers, with its request-concurrency context
  resource (``s3_request_concurrency`` / ``gcs_request_concurrency``) and OCDBT's
  ``target_data_file_size`` varied.

Contenders alternate (the first rotates every repetition); figures are medians with
the worst-best range. Emulators on localhost are not clouds: no network latency, no
per-connection bandwidth cap, and their own costs (moto reads the whole object for
every ranged GET). Use the ratios to choose among settings, not as cloud speeds.

    python benchmarks/object_reads.py                       # 128 MiB object, 96 MiB tree
    python benchmarks/object_reads.py --size 32 --tree 24 --reps 2   # quick look
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import (
    RESULTS,
    MiB,
    MotoProcess,
    Stats,
    Timer,
    interleave,
    machine_info,
    markdown_table,
    run_async,
    scratch_dir,
    sigterm_as_interrupt,
    timed,
    utc_timestamp,
    write_results,
)
from benchmarks.storage import Verify, moto_environment

SERVERS = ("s3", "gcs")
PACKAGES = ("ckptstore", "tensorstore", "numpy", "s3fs", "aiobotocore", "gcsfs", "aiohttp", "moto")
#: (label, part size in MiB or None for a single GET, concurrency)
READ_SETTINGS = [
    ("single GET", None, 1),
    ("8 MiB x 8", 8, 8),
    ("16 MiB x 8", 16, 8),
    ("32 MiB x 8", 32, 8),
    ("32 MiB x 4", 32, 4),
    ("64 MiB x 4", 64, 4),
]
#: (label, TensorStore request concurrency or None for its default, OCDBT data file MiB)
TS_SETTINGS = [
    ("default (32), files 64 MiB", None, 64),
    ("concurrency 8, files 64 MiB", 8, 64),
    ("concurrency 64, files 64 MiB", 64, 64),
    ("default (32), files 16 MiB", None, 16),
    ("default (32), files 256 MiB", None, 256),
]


class Server:
    """One emulator and a factory for backends on one bucket of it."""

    def __init__(self, kind: str, endpoint: str, bucket: str) -> None:
        self.kind, self.endpoint, self.bucket = kind, endpoint, bucket

    def backend(self, prefix: str, **options: Any) -> Any:
        if self.kind == "s3":
            from ckptstore.backends.s3 import S3Backend

            return S3Backend(
                self.bucket, prefix, endpoint_url=self.endpoint, credentials="env", **options
            )
        from ckptstore.backends.gcs import GcsBackend

        return GcsBackend(
            self.bucket,
            prefix,
            endpoint_url=self.endpoint,
            credentials="anonymous",
            emulator=True,
            **options,
        )


@contextmanager
def emulator(kind: str, scratch: Path) -> Iterator[Server]:
    """moto (in a child process) or fake-gcs-server, with the environment pointed at it."""
    from ckptstore.testing.servers import FakeGcsServer, create_moto_bucket, unique_bucket_name

    if kind == "s3":
        with MotoProcess(scratch / "moto-tmp") as moto, moto_environment():
            bucket = create_moto_bucket(moto.endpoint, unique_bucket_name("bench"))
            yield Server(kind, moto.endpoint, bucket)
        return
    with FakeGcsServer() as gcs:
        saved = {
            k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST")
        }
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = os.environ["STORAGE_EMULATOR_HOST"] = gcs.endpoint
        try:
            yield Server(kind, gcs.endpoint, gcs.create_bucket())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


async def bench_reads(server: Server, size: int, reps: int) -> list[dict[str, Any]]:
    data = np.random.default_rng(0).bytes(size)
    async with AsyncExitStack() as stack:
        writer = server.backend("reads")
        stack.push_async_callback(writer.close)
        await writer.write("object.bin", data)
        backends = []
        for _, part, conc in READ_SETTINGS:
            part_size = (part * MiB) if part else size + MiB
            b = server.backend("reads", read_part_size=part_size, read_concurrency=conc)
            stack.push_async_callback(b.close)
            backends.append(b)
        runners = [timed(lambda b=b: b.read("object.bin"), after=Verify(data)) for b in backends]
        stats = await interleave(reps, runners)
        await writer.delete("object.bin")
    return [
        {"setting": label, "bytes": size, **s.to_json(size)}
        for (label, _, _), s in zip(READ_SETTINGS, stats, strict=True)
    ]


def make_tree(total: int) -> dict[str, np.ndarray]:
    """Four large float32 leaves holding 3/4 of ``total`` plus 1 MiB leaves for the rest."""
    rng = np.random.default_rng(1)
    big = total * 3 // 4 // 4 // 4
    tree = {f"w{i}": rng.random(big, dtype=np.float32) for i in range(4)}
    for i in range(max(1, (total - 4 * big * 4) // MiB)):
        tree[f"b{i:03d}"] = rng.random(MiB // 4, dtype=np.float32)
    return tree


async def bench_tensorstore(server: Server, tree_bytes: int, reps: int) -> list[dict[str, Any]]:
    import ckptstore
    from ckptstore.datapath import stores

    tree = make_tree(tree_bytes)
    nbytes = sum(a.nbytes for a in tree.values())
    saves = [Stats() for _ in TS_SETTINGS]
    restores = [Stats() for _ in TS_SETTINGS]
    async with AsyncExitStack() as stack:
        backends = []
        for i, (_, conc, _) in enumerate(TS_SETTINGS):
            b = server.backend(f"ts{i}", ts_request_concurrency=conc)
            stack.push_async_callback(b.close)
            backends.append(b)
        steps = [0] * len(TS_SETTINGS)

        def runner(i: int) -> Any:
            async def run() -> float:
                backend, file_mib = backends[i], TS_SETTINGS[i][2]
                steps[i] += 1
                previous, stores.DATA_FILE_BYTES = stores.DATA_FILE_BYTES, file_mib * MiB
                try:
                    with Timer() as t_save:
                        await ckptstore.save(backend, tree, step=steps[i])
                finally:
                    stores.DATA_FILE_BYTES = previous
                with Timer() as t_restore:
                    got = await ckptstore.restore(backend, steps[i])
                if steps[i] == 1:
                    assert all(np.array_equal(got[k], v) for k, v in tree.items())
                del got
                await ckptstore.delete_step(backend, steps[i])
                saves[i].runs.append(t_save.seconds)
                restores[i].runs.append(t_restore.seconds)
                return t_save.seconds + t_restore.seconds

            return run

        await interleave(reps, [runner(i) for i in range(len(TS_SETTINGS))])
    return [
        {
            "setting": label,
            "ts_request_concurrency": conc,
            "target_data_file_size_mib": mib,
            "bytes": nbytes,
            "leaves": len(tree),
            "save": saves[i].to_json(nbytes),
            "restore": restores[i].to_json(nbytes),
        }
        for i, (label, conc, mib) in enumerate(TS_SETTINGS)
    ]


def _cell(row: dict[str, Any]) -> str:
    return f"{row['median_gbps']:.2f} ({row['worst_gbps']:.2f}-{row['best_gbps']:.2f})"


def report(results: dict[str, Any]) -> str:
    lines = []
    for kind, res in results.items():
        rows = [[kind, r["setting"], f"{r['bytes'] // MiB} MiB", _cell(r)] for r in res["reads"]]
        if rows:
            lines.append(markdown_table(["server", "read", "size", "GB/s"], rows))
        rows = [
            [kind, r["setting"], f"{r['bytes'] // MiB} MiB", _cell(r["save"]), _cell(r["restore"])]
            for r in res["tensorstore"]
        ]
        if rows:
            headers = ["server", "tensorstore", "tree", "save GB/s", "restore GB/s"]
            lines.append(markdown_table(headers, rows))
    return "\n\n".join(lines)


async def run_all(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in args.servers:
        print(f"{kind}: {', '.join(args.parts)} ({args.size} / {args.tree} MiB) ...", flush=True)
        with emulator(kind, scratch) as server:
            results[kind] = {"reads": [], "tensorstore": []}
            if "reads" in args.parts:
                results[kind]["reads"] = await bench_reads(server, args.size * MiB, args.reps)
            if "tensorstore" in args.parts:
                tree = await bench_tensorstore(server, args.tree * MiB, args.reps)
                results[kind]["tensorstore"] = tree
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=128, metavar="MIB", help="object read (MiB)")
    p.add_argument("--tree", type=int, default=96, metavar="MIB", help="tree saved (MiB)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--servers", default=",".join(SERVERS), help="s3,gcs or one of them")
    p.add_argument("--parts", default="reads,tensorstore", help="reads,tensorstore or one")
    p.add_argument("--output", type=Path, default=RESULTS / "object_reads.json")
    p.add_argument("--no-write-results", action="store_true")
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    args.parts = [s for s in args.parts.split(",") if s]
    if set(args.servers) - set(SERVERS) or args.reps < 1:
        p.error("bad --servers or --reps")
    try:
        with sigterm_as_interrupt(), scratch_dir("ckptstore-objread-") as scratch:
            machine = machine_info(PACKAGES, scratch)
            results = run_async(run_all(args, scratch))
    except KeyboardInterrupt:
        print("\ninterrupted; servers and temporary files removed", file=sys.stderr)
        return 130
    print()
    print(report(results))
    if not args.no_write_results:
        payload = {
            "benchmark": "object_reads",
            "timestamp": utc_timestamp(),
            "command": " ".join(["python", "benchmarks/object_reads.py", *sys.argv[1:]]),
            "config": {
                "size_mib": args.size,
                "tree_mib": args.tree,
                "reps": args.reps,
                "parts": args.parts,
                "order": "interleaved; which contender goes first rotates every repetition",
                "caveat": "emulators on 127.0.0.1 are not clouds: compare settings, not speeds",
            },
            "machine": {**machine, "load_avg_at_end": list(os.getloadavg())},
            "results": results,
        }
        write_results(args.output, payload)
        print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
