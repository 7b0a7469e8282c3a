"""Helpers shared by the benchmarks: timing, interleaved repetitions, statistics,
scratch directories that are always removed, machine info and result files.

Figures on a shared 2-core VM vary ~2x from run to run, so every benchmark here
measures a contender and its baseline in the same run, alternating them, and
reports the ratio of medians rather than absolute speeds alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
T = TypeVar("T")


# ---- timing and statistics ------------------------------------------------------------


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds`` (wall clock, `time.perf_counter`)."""

    seconds: float = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


@dataclass
class Stats:
    """Repeated timings of one measurement (seconds), summarised by median, min and max."""

    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def min(self) -> float:
        return min(self.runs)

    @property
    def max(self) -> float:
        return max(self.runs)

    def to_json(self, nbytes: int | None = None) -> dict[str, Any]:
        """Raw runs plus summary; with ``nbytes`` also throughputs in GB/s (10^9 B/s)."""
        out: dict[str, Any] = {
            "runs_s": [round(r, 6) for r in self.runs],
            "median_s": round(self.median, 6),
            "min_s": round(self.min, 6),
            "max_s": round(self.max, 6),
        }
        if nbytes is not None:
            out["median_gbps"] = round(gbps(nbytes, self.median), 4)
            out["best_gbps"] = round(gbps(nbytes, self.min), 4)
            out["worst_gbps"] = round(gbps(nbytes, self.max), 4)
        return out


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (decimal gigabytes, as dd reports)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


Runner = Callable[[], Awaitable[float]]


async def interleave(
    reps: int, runners: Sequence[Runner], *, min_seconds: float = 0.0, max_reps: int = 0
) -> list[Stats]:
    """Run each runner at least ``reps`` times, rotating which goes first every repetition.

    A runner does its own untimed set-up and returns the seconds of its timed
    part, so slow drift (write-back, other tenants) hits every contender alike.
    The number of repetitions is a multiple of ``len(runners)``, so each runner
    holds each position equally often. With ``min_seconds``, short operations
    get more repetitions (up to about ``max_reps``) until every runner has been
    timed for that long in total.
    """
    stats = [Stats() for _ in runners]
    n = len(runners)
    rep = 0
    while (
        rep < reps or rep % n or (rep < max_reps and min(sum(s.runs) for s in stats) < min_seconds)
    ):
        for k in range(n):
            i = (rep + k) % n
            stats[i].runs.append(await runners[i]())
        rep += 1
    return stats


async def nothing() -> None:
    """The default ``before`` of `timed`: no set-up."""


def timed(
    op: Callable[[], Awaitable[Any]],
    *,
    before: Callable[[], Awaitable[Any]] = nothing,
    after: Callable[[Any], None] | None = None,
) -> Runner:
    """A runner for `interleave`: ``op()`` timed; ``before()`` and ``after(result)`` untimed."""

    async def run() -> float:
        await before()
        with Timer() as t:
            result = await op()
        if after is not None:
            after(result)
        del result
        return t.seconds

    return run


# ---- contender vs baselines -------------------------------------------------------------


@dataclass
class Baseline:
    """One raw baseline of a measurement, with the floor ckptstore must reach (if any)."""

    name: str
    stats: Stats
    floor: float | None = None


@dataclass
class Measurement:
    """ckptstore's timings of one operation on ``nbytes`` and the baselines it faces."""

    backend: str
    op: str
    nbytes: int
    contender: str
    stats: Stats
    baselines: list[Baseline] = field(default_factory=list)


def ratio(m: Measurement, b: Baseline) -> float:
    """ckptstore throughput / baseline throughput, from median times (>1: ckptstore faster)."""
    return b.stats.median / m.stats.median


def verdict(m: Measurement, b: Baseline) -> str:
    """PASS or FAIL against the baseline's floor; "info" if it has none."""
    if b.floor is None:
        return "info"
    return "PASS" if ratio(m, b) >= b.floor else "FAIL"


def failed_floors(results: Sequence[Measurement]) -> list[str]:
    return [
        f"{m.backend} {m.op} vs {b.name}"
        for m in results
        for b in m.baselines
        if verdict(m, b) == "FAIL"
    ]


def _gbps_range(nbytes: int, stats: Stats) -> str:
    median, lo, hi = (gbps(nbytes, s) for s in (stats.median, stats.max, stats.min))
    return f"{median:.2f} ({lo:.2f}-{hi:.2f})"


def comparison_table(results: Sequence[Measurement]) -> str:
    """One row per (measurement, baseline): median GB/s (worst-best), ratio, floor, verdict."""
    headers = "backend op size reps ckptstore_GB/s baseline baseline_GB/s ratio floor verdict"
    rows = [
        [
            m.backend,
            m.op,
            f"{m.nbytes // MiB} MiB",
            str(len(m.stats.runs)),
            _gbps_range(m.nbytes, m.stats),
            b.name,
            _gbps_range(m.nbytes, b.stats),
            f"{ratio(m, b):.2f}x",
            "-" if b.floor is None else f">= {b.floor:.1f}x",
            verdict(m, b),
        ]
        for m in results
        for b in m.baselines
    ]
    return markdown_table([h.replace("_", " ") for h in headers.split()], rows)


def measurements_json(results: Sequence[Measurement]) -> list[dict[str, Any]]:
    """Every raw timing, the medians, min/max, throughputs, ratios and verdicts."""
    return [
        {
            "backend": m.backend,
            "op": m.op,
            "bytes": m.nbytes,
            "contender": m.contender,
            "ckptstore": m.stats.to_json(m.nbytes),
            "baselines": [
                {
                    "name": b.name,
                    **b.stats.to_json(m.nbytes),
                    "ratio": round(ratio(m, b), 4),
                    "floor": b.floor,
                    "verdict": verdict(m, b),
                }
                for b in m.baselines
            ],
        }
        for m in results
    ]


# ---- scratch space and clean-up ---------------------------------------------------------


def _same_device(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


def pick_scratch_base(near: Path = REPO) -> Path:
    """``/var/tmp`` or ``/tmp`` if on the same filesystem as ``near``, else ``near``'s parent."""
    for base in (Path("/var/tmp"), Path("/tmp")):
        if base.is_dir() and os.access(base, os.W_OK) and _same_device(base, near):
            return base
    return near.parent


def memory_base(need: int = 4 << 30) -> Path | None:
    """``/dev/shm`` where it is a tmpfs with ``need`` bytes free, else None (the disk).

    For a stand-in server's files (moto spools objects over 5 MiB to ``TMPDIR``): a real
    object store does not write to the disk the benchmark measures, so its writes must not
    be flushed there while the next timed save runs."""
    shm = Path("/dev/shm")
    try:
        usage = shutil.disk_usage(shm)
    except OSError:
        return None
    return shm if usage.free >= need else None


@contextlib.contextmanager
def scratch_dir(prefix: str, base: Path | None = None) -> Iterator[Path]:
    """A fresh directory under ``base`` (default: `pick_scratch_base`), removed on any exit,
    ``kill`` (SIGTERM) included: a benchmark leaves no GiBs behind (`sigterm_as_interrupt`,
    where signals can be handled: the main thread)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base or pick_scratch_base()))
    on_main = threading.current_thread() is threading.main_thread()
    try:
        with sigterm_as_interrupt() if on_main else contextlib.nullcontext():
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into `KeyboardInterrupt` so ``finally`` clean-up runs on ``kill`` too."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, where SIGTERM cancels the main task as Ctrl-C does.

    Cancellation lets every ``finally`` / ``async with`` clean-up (buckets,
    servers, temporary files) run on the loop; either signal then surfaces as
    `KeyboardInterrupt`.
    """

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        previous = signal.getsignal(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await main
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, previous)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        raise KeyboardInterrupt("SIGTERM") from None


# ---- reporting ------------------------------------------------------------------------


def utc_timestamp() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _read_first(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _filesystem(path: Path) -> dict[str, str]:
    try:
        out = subprocess.run(
            ["df", "--output=source,fstype,size", "-B1", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return {}
    source, fstype, size = out.split()
    return {"path": str(path), "device": source, "fstype": fstype, "size_bytes": size}


def machine_info(packages: Iterable[str], scratch: Path | None = None) -> dict[str, Any]:
    """Cores, memory, CPU, OS, Python, package versions and the scratch filesystem."""
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    mem = _read_first("/proc/meminfo", "MemTotal")
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _read_first("/proc/cpuinfo", "model name"),
        "mem_total_kib": int(mem.split()[0]) if mem else None,
        "load_avg_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": versions,
    }
    if scratch is not None:
        info["scratch_fs"] = _filesystem(scratch)
    return info


def recycle_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of new memory and free it: whatever runs next finds free memory
    that the host has not taken back.

    On these VMs the guest reports the memory it frees to the host (virtio-balloon free
    page reporting, within about a second), and the first touch of such a page costs
    several times a plain one: 1 GiB touched in 0.65-1.1 s against 0.10 s (see
    docs/benchmarks.md, "The host takes freed memory back"). Left alone, an operation
    that lands its result in new memory (a restore, unlike ``dd`` to ``/dev/null``) is
    fast or slow depending on how long ago something else freed memory; after this,
    every contender starts alike, as on a machine that does not report.
    """
    import numpy as np  # numpy-free callers of this module need not load it

    block = np.ones(nbytes, np.uint8)  # ones, not zeros: calloc would touch nothing
    del block


def release_memory() -> None:
    """Hand memory freed by the last phase back to the system: glibc keeps what thousands
    of small arrays freed in its per-thread arenas, so a run over several trees would
    otherwise hold the high-water mark of all of them (one full-size run was OOM-killed)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def write_results(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A pipe table, column-aligned so it reads well in a terminal and in Markdown."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


# ---- emulators --------------------------------------------------------------------------

_MOTO_CHILD = """
import sys
from ckptstore.testing.servers import MotoS3Server
with MotoS3Server() as server:
    print(server.endpoint, flush=True)
    sys.stdin.read()  # until the parent closes stdin (or dies)
"""


class _ChildServer:
    """A server run in a child process that prints its endpoint and exits when its stdin
    closes (so it cannot outlive us). In-process, a threaded server would share this
    interpreter's GIL with the client being measured; a child behaves like a real one."""

    what = "server"

    def __init__(self) -> None:
        self.endpoint = ""
        self._proc: subprocess.Popen[str] | None = None

    def _start(self, args: list[str], env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the child ourselves
        )
        try:
            assert self._proc.stdout is not None
            line = self._proc.stdout.readline().strip()
            if not line.startswith("http://"):
                raise RuntimeError(
                    f"{self.what} child did not start (exit code {self._proc.poll()})"
                )
            self.endpoint = line
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class MotoProcess(_ChildServer):
    """`ckptstore.testing.servers.MotoS3Server` run in a child process (`_ChildServer`).
    The child's temporary files (moto spools objects over 5 MiB to disk) go to ``tmpdir``.
    """

    what = "moto"

    def __init__(self, tmpdir: Path) -> None:
        super().__init__()
        self.tmpdir = tmpdir

    def __enter__(self) -> MotoProcess:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self._start([_MOTO_CHILD], dict(os.environ, TMPDIR=str(self.tmpdir), JAX_PLATFORMS="cpu"))
        return self


class ProxyProcess(_ChildServer):
    """`ckptstore.testing.faultproxy` run in a child process (`_ChildServer`) in front of
    ``upstream``, passing everything through, its bodies capped at ``rate_limit`` bytes/s
    (a slow link): the proxy's pacing and copying do not share the measured client's GIL.
    """

    what = "proxy"

    def __init__(self, upstream: str, rate_limit: float | None = None) -> None:
        super().__init__()
        self.upstream, self.rate_limit = upstream, rate_limit

    def __enter__(self) -> ProxyProcess:
        args = [_PROXY_CHILD, self.upstream]
        if self.rate_limit is not None:
            args += ["--rate-limit", repr(float(self.rate_limit))]
        self._start(args, dict(os.environ, PYTHONPATH=str(REPO)))
        return self


_PROXY_CHILD = """
import sys
from ckptstore.testing.faultproxy import FaultProxy
args = sys.argv[1:]
limit = float(args[2]) if args[1:2] == ["--rate-limit"] else None
with FaultProxy(args[0], rate_limit_bytes_per_s=limit) as proxy:
    print(proxy.endpoint, flush=True)
    sys.stdin.read()  # until the parent closes stdin (or dies)
"""
