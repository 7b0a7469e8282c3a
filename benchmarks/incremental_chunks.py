"""The chunk-level scenario of `benchmarks/incremental.py`: a sparsely updated embedding table.

A float32 table (``--chunks-mib``, 256 MiB by default: 65536 x 1024), sharded by rows over 8
CPU devices and stored in chunks of ``CHUNK`` (2,048 chunks at 256 MiB), changes in
``FRACTION`` of its chunks per step (one element each, chunks drawn at random). Each step
is saved three times, side by side, in an order that rotates: ``save(base=previous step)``
into one root (the changed chunks found by hashing), ``save(base=previous step's
SaveResult, changed={"t": the touched rows})`` into another (only the chunks holding a
declared row hashed: `ckptstore.checkpoint.declared`), and a full save into a third (all
`save_sync`, which returns once the step is committed: its time to durable). Between and
after them, in an order that rotates,
what bounds the incremental save on this machine (`LIMITS`): the chunk digests of the table
as a save computes them (its `piece_table` of the pieces this process owns), one BLAKE3
pass over the table's bytes (its own threads), and the commit of a step that writes nothing
new (the previous step's very arrays saved again with ``base=`` it, vouched the same
objects as the manager does: nothing hashed, nothing written; deleted again, untimed), and a
full save of only the changed chunks' bytes (each changed chunk a leaf of its own, copied
out untimed, into a root of its own: what any save of this step must write and commit, with
its change detection free), and the hardware's own limit for those bytes: the changed
chunks' bytes written into one new file and fsynced, then a small commit file written,
fsynced and renamed into place and its directory fsynced (``raw_changed``). The limit of a
step is its digests plus that commit: a save that finds the changed chunks by hashing
cannot take less. The machine's own bound for such a save, whatever its protocol: one
BLAKE3 pass over the table (the format's digest) plus the raw store of the new bytes.

The saves go to local disk, or (``--chunks-storage s3`` of `benchmarks/incremental.py`)
to moto's S3 server in a child process, the same names as prefixes of one bucket; there
the raw limit is one object of the new bytes, then a small commit object.

Reported, over the later steps: bytes written per incremental save against the table's, the
median (and spread) of both saves' times, of each limit and of the limit; each incremental
step restores bit-exact; then the base (step 1) and every step but the last are deleted,
`gc` runs with no grace, and every step still listed restores bit-exact.

Floors: bytes written <= 3% of the table's; time to durable <= 0.1x a full save's, judged
for each of the two incremental saves.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks.common import MiB
from ckptstore.api import save_items
from ckptstore.checkpoint.incremental import SameObjects
from ckptstore.datapath.arrays import owned_slices
from ckptstore.format.digests import digest, piece_table
from ckptstore.runtime.blocking import blocking
from ckptstore.runtime.blocking import run as run_on_loop

CHUNK = 128 << 10  # chunk_bytes: chunks of 128 x 256 (2,048 at 256 MiB)
FRACTION = 0.02
FLOORS = {"bytes": 0.03, "durable": 0.1}
#: The saves of each step: found by hashing, declared rows, full.
SAVES = ("incremental", "declared", "full")
#: What is timed beside the saves: the table's chunk digests as a save computes them, one
#: BLAKE3 pass over its bytes, the commit of a step that writes nothing new, a save of only
#: the changed chunks' bytes, and those bytes written and committed raw (the hardware's limit).
LIMITS = ("digests", "blake3", "nothing_new", "changed_only", "raw_changed")
NOTHING_NEW = 10_000  # the nothing-new commits' steps: this plus the step they repeat
save_items_sync = blocking(save_items)


def _sharded(host: np.ndarray[Any, Any]) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    return jax.device_put(host, NamedSharding(mesh, P("x", None)))


def _touch(
    host: np.ndarray[Any, Any], rng: np.random.Generator, chunk: tuple[int, ...]
) -> tuple[dict[str, np.ndarray[Any, Any]], list[int]]:
    """Change one element in each of `FRACTION` of the table's chunks, in place: the changed
    chunks' new values, one leaf each (copies), and the rows touched (what a sparse
    optimizer would declare)."""
    grid = [-(-n // c) for n, c in zip(host.shape, chunk, strict=True)]
    count = max(1, int(FRACTION * grid[0] * grid[1]))
    changed: dict[str, np.ndarray[Any, Any]] = {}
    rows = set()
    for linear in rng.choice(grid[0] * grid[1], size=count, replace=False):
        r, c = divmod(int(linear), grid[1])
        host[r * chunk[0], c * chunk[1]] += 1.0
        rows.add(r * chunk[0])
        region = host[r * chunk[0] : (r + 1) * chunk[0], c * chunk[1] : (c + 1) * chunk[1]]
        changed[f"chunk_{int(linear)}"] = region.copy()
    return changed, sorted(rows)


@dataclass(frozen=True)
class Storage:
    """Where the scenario's saves go: directories below ``root`` (local disk), or with
    ``bucket`` the same names as prefixes of a moto S3 bucket (``$AWS_ENDPOINT_URL``
    names the server)."""

    root: Path
    bucket: str | None = None

    @property
    def name(self) -> str:
        return "local" if self.bucket is None else "s3"

    def url(self, who: str) -> str:
        return str(self.root / who) if self.bucket is None else f"s3://{self.bucket}/{who}"

    def raw_commit(self, step: int, chunks: Iterable[np.ndarray[Any, Any]]) -> None:
        """The step's new bytes stored raw, then committed (`_raw_commit`; on S3: one
        object of the bytes, then a small commit object)."""
        if self.bucket is None:
            _raw_commit(self.root / "raw_changed", step, chunks)
            return
        data = b"".join(np.ascontiguousarray(c).tobytes() for c in chunks)
        run_on_loop(_s3_raw_commit(self.bucket, step, data))

    def raw_clean(self) -> None:
        if self.bucket is None:
            shutil.rmtree(self.root / "raw_changed")


async def _s3_raw_commit(bucket: str, step: int, data: bytes) -> None:
    from ckptstore.backends.s3 import S3Backend

    async with S3Backend(bucket, "raw_changed", credentials="env") as backend:
        await backend.write(f"{step}.bin", data)
        await backend.write(f"{step}.commit", f'{{"step": {step}}}'.encode())


@contextmanager
def moto_storage(scratch: Path) -> Iterator[Storage]:
    """moto S3 in a child process (objects spooled below ``scratch``), a bucket, and the
    environment pointing at it, for the scenario's saves."""
    from benchmarks.common import MotoProcess
    from benchmarks.storage import moto_environment
    from ckptstore.testing.servers import create_moto_bucket, unique_bucket_name

    with MotoProcess(scratch / "moto-tmp") as moto, moto_environment():
        os.environ["AWS_ENDPOINT_URL"] = moto.endpoint  # restored with the environment
        yield Storage(scratch, create_moto_bucket(moto.endpoint, unique_bucket_name("chunks")))


def run(mib: int, steps: int, storage: Storage) -> dict[str, Any]:
    """The scenario (module docstring) on ``storage``; its figures and floors."""
    rows = max(64, mib * MiB // 4 // 1024 // 64 * 64)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((rows, 1024), dtype=np.float32)
    roots = {who: storage.url(who) for who in SAVES}
    previous = {"t": _sharded(host)}  # the arrays of the step before: see `_nothing_new`
    last: dict[str, ckptstore.SaveResult] = {}
    for who in SAVES:
        last[who] = ckptstore.save_sync(roots[who], previous, step=1, chunk_bytes=CHUNK)
    chunk = ckptstore.read_manifest_sync(roots["full"], 1).items["state"].leaves["t"].chunk_shape
    durable: dict[str, list[float]] = {who: [] for who in SAVES}
    limits: dict[str, list[float]] = {k: [] for k in LIMITS}
    written: dict[str, list[int]] = {"incremental": [], "declared": []}
    kept: dict[int, str] = {}  # each step's table, as its digest (copies would cost GiBs)
    for step in range(2, steps + 2):
        changed, touched = _touch(host, rng, chunk)
        tree = {"t": _sharded(host)}
        jax.block_until_ready(tree)
        saves = SAVES[step % 3 :] + SAVES[: step % 3]
        others = LIMITS[step % len(LIMITS) :] + LIMITS[: step % len(LIMITS)]
        order = [x for pair in zip(saves, others, strict=False) for x in pair] + list(others[3:])
        for who in order:
            start = time.perf_counter()
            if who in SAVES:
                base = None if who == "full" else last[who] if who == "declared" else step - 1
                declared = {"t": touched} if who == "declared" else None
                last[who] = ckptstore.save_sync(
                    roots[who],
                    tree,
                    step=step,
                    base=base,
                    changed=declared,
                    chunk_bytes=CHUNK,
                )
                durable[who].append(time.perf_counter() - start)
                if who in written:
                    written[who].append(last[who].bytes_written)
                continue
            if who == "digests":  # as `save(base=)` finds the changed chunks
                pieces = owned_slices(tree["t"], 0)
                run_on_loop(piece_table(pieces, host.shape, chunk, host.itemsize, {}))
            elif who == "blake3":
                blake3.blake3(host.reshape(-1).view(np.uint8), max_threads=blake3.blake3.AUTO)
            elif who == "changed_only":  # what this step must write, in a root of its own
                ckptstore.save_sync(storage.url("changed_only"), changed, step=step)
            elif who == "raw_changed":
                storage.raw_commit(step, changed.values())
            else:  # the previous step again, with it as the base: nothing hashed or written
                again = _nothing_new(roots["incremental"], previous, step - 1)
            limits[who].append(time.perf_counter() - start)
            if who == "nothing_new":
                assert again.bytes_written == 0, again.bytes_written
                ckptstore.delete_step_sync(roots["incremental"], NOTHING_NEW + step - 1)
            if who == "changed_only":
                ckptstore.delete_step_sync(storage.url("changed_only"), step)
            if who == "raw_changed":
                storage.raw_clean()
        kept[step] = digest(host)
        previous = tree
        del tree
    out = _figures(host.nbytes, chunk, rows, durable, limits, written, kept, roots, steps)
    return {"storage": storage.name, **out}


def _raw_commit(where: Path, step: int, chunks: Iterable[np.ndarray[Any, Any]]) -> None:
    """The hardware's limit for a step's new bytes: ``chunks`` written into one new file and
    fsynced, then a small commit file written, fsynced, renamed into place, and the
    directory fsynced (the caller removes them, untimed)."""
    where.mkdir(parents=True, exist_ok=True)
    data = where / f"{step}.bin"
    fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in chunks:
            os.write(fd, np.ascontiguousarray(chunk).data)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp = where / f".{step}.commit"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, f'{{"step": {step}}}'.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, where / f"{step}.commit")
    dirfd = os.open(where, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def _figures(
    table_bytes: int,
    chunk: tuple[int, ...],
    rows: int,
    durable: dict[str, list[float]],
    limits: dict[str, list[float]],
    written: dict[str, list[int]],
    kept: dict[int, str],
    roots: dict[str, str],
    steps: int,
) -> dict[str, Any]:
    """The restores' checks, then the figures and floors of `run`."""
    checks = {who: _restores(roots[who], kept, steps) for who in ("incremental", "declared")}
    med = {k: statistics.median(v) for k, v in durable.items()}
    bound = [d + c for d, c in zip(limits["digests"], limits["nothing_new"], strict=True)]
    limit = statistics.median(bound)
    lim_med = {k: statistics.median(v) for k, v in limits.items()}
    ratio_bytes = {who: max(w) / table_bytes for who, w in written.items()}
    ratio_durable = {who: med[who] / med["full"] for who in written}
    return {
        "table_bytes": table_bytes,
        "chunk_shape": list(chunk),
        "chunks": -(-rows // chunk[0]) * -(-1024 // chunk[1]),
        "changed_fraction": FRACTION,
        "bytes_written": written,
        "durable_s": durable,
        "medians_s": {k: round(v, 4) for k, v in med.items()},
        "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in durable.items()},
        "limits": {
            "seconds": limits,
            "medians_s": {k: round(v, 4) for k, v in lim_med.items()},
            "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in limits.items()},
            "limit_s": bound,
            "limit_median_s": round(limit, 4),
            "limit_spread_s": [round(min(bound), 4), round(max(bound), 4)],
        },
        "ratios": {
            "bytes_written_vs_table": round(ratio_bytes["incremental"], 4),
            "declared_bytes_written_vs_table": round(ratio_bytes["declared"], 4),
            "durable_vs_full": round(ratio_durable["incremental"], 4),
            "declared_durable_vs_full": round(ratio_durable["declared"], 4),
            "limit_vs_full": round(limit / med["full"], 4),
            "changed_only_vs_full": round(lim_med["changed_only"] / med["full"], 4),
            "raw_changed_vs_full": round(lim_med["raw_changed"] / med["full"], 4),
            # What a save that must find its changes cannot go below on this machine: one
            # BLAKE3 pass over the table (the format's digest; every core), then the new
            # bytes stored raw and committed.
            "blake3_vs_full": round(lim_med["blake3"] / med["full"], 4),
            "hashed_bound_vs_full": round(
                (lim_med["blake3"] + lim_med["raw_changed"]) / med["full"], 4
            ),
            "durable_vs_limit": round(med["incremental"] / limit, 4),
            "declared_vs_changed_only": round(med["declared"] / lim_med["changed_only"], 4),
        },
        "restores": checks,
        "floors": {
            "bytes": max(ratio_bytes.values()) <= FLOORS["bytes"],
            "durable": ratio_durable["incremental"] <= FLOORS["durable"],
            "durable_declared": ratio_durable["declared"] <= FLOORS["durable"],
            "restore": all(all(c.values()) for c in checks.values()),
        },
    }


def _restores(root: str, kept: dict[int, str], steps: int) -> dict[str, bool]:
    """Every step of ``root`` restores bit-exact; then with the base (step 1) and every
    step but the last deleted and `gc` run with no grace, the last one still does, and
    verifies."""
    exact = all(digest(ckptstore.restore_sync(root, s)["t"]) == v for s, v in kept.items())
    for step in range(1, steps + 1):
        ckptstore.delete_step_sync(root, step)
    ckptstore.gc_sync(root, older_than=0)
    last = steps + 1
    after_gc = ckptstore.list_steps_sync(root) == [last] and (
        digest(ckptstore.restore_sync(root, last)["t"]) == kept[last]
    )
    return {
        "restored_bit_exact": exact,
        "restored_after_base_deleted_and_gc": after_gc,
        "verified_after_gc": ckptstore.verify_sync(root, last).ok,
    }


def _nothing_new(root: str, tree: dict[str, Any], step: int) -> ckptstore.SaveResult:
    """Step ``step``'s very arrays saved again as step `NOTHING_NEW` + ``step`` with it as the
    base, vouched the same objects (as the manager vouches them): committed, nothing new."""
    attempt = ckptstore.read_manifest_sync(root, step).attempt
    assert attempt is not None
    return save_items_sync(
        root,
        {"state": tree},
        step=NOTHING_NEW + step,
        base=step,
        same_objects=SameObjects(attempt, {"state": {"t"}}),
        chunk_bytes=CHUNK,
    )


def rows_of(r: dict[str, Any]) -> list[list[str]]:
    """The scenario's lines of the benchmark's table."""
    q, f, m, s = r["ratios"], r["floors"], r["medians_s"], r["spread_s"]
    verdict = {k: "PASS" if ok else "FAIL" for k, ok in f.items()}
    tree = "chunks" if r["storage"] == "local" else f"chunks {r['storage']}"

    def spread(who: str) -> str:
        return f"{who} {m[who]} s [{s[who][0]}-{s[who][1]}]"

    lim, lm = r["limits"], r["limits"]["medians_s"]
    parts = (
        f"digests {lm['digests']} s + nothing-new commit {lm['nothing_new']} s; "
        f"one BLAKE3 pass {lm['blake3']} s"
    )
    bytes_ratio = f"{q['bytes_written_vs_table']}x / {q['declared_bytes_written_vs_table']}x"
    return [
        [
            tree,
            "bytes written / table (later saves: hashed / declared)",
            bytes_ratio,
            f"<= {FLOORS['bytes']}x",
            verdict["bytes"],
        ],
        [
            tree,
            f"time to durable / full save, hashed ({spread('incremental')}, {spread('full')})",
            f"{q['durable_vs_full']}x",
            f"<= {FLOORS['durable']}x",
            verdict["durable"],
        ],
        [
            tree,
            f"time to durable / full save, declared rows ({spread('declared')})",
            f"{q['declared_durable_vs_full']}x",
            f"<= {FLOORS['durable']}x",
            verdict["durable_declared"],
        ],
        [
            tree,
            f"hashing limit / full save (limit {lim['limit_median_s']} s: {parts})",
            f"{q['limit_vs_full']}x",
            "-",
            "info",
        ],
        [
            tree,
            "time to durable, hashed / hashing limit",
            f"{q['durable_vs_limit']}x",
            "-",
            "info",
        ],
        [
            tree,
            f"a save of only the changed chunks / full save ({lm['changed_only']} s)",
            f"{q['changed_only_vs_full']}x",
            "-",
            "info",
        ],
        [
            tree,
            f"the changed bytes stored raw, then a commit file / full save ({lm['raw_changed']} s)",
            f"{q['raw_changed_vs_full']}x",
            "-",
            "info",
        ],
        [
            tree,
            f"one BLAKE3 pass over the table ({lm['blake3']} s), then the changed bytes stored "
            f"raw / full save (the bound of any save that finds its changes; the pass alone "
            f"{q['blake3_vs_full']}x)",
            f"{q['hashed_bound_vs_full']}x",
            "-",
            "info",
        ],
        [
            tree,
            "declared save / a save of only the changed chunks",
            f"{q['declared_vs_changed_only']}x",
            "-",
            "info",
        ],
        [
            tree,
            "bit-exact restores, also after base deleted + gc",
            "-",
            "all",
            verdict["restore"],
        ],
    ]


#: The bars of `figure_of`: what each measure is, and its key in a run's results.
BARS = (
    ("hashed save", "incremental"),
    ("declared save", "declared"),
    ("a save of only the changed chunks", "changed_only"),
    ("a commit of nothing new", "nothing_new"),
    ("one BLAKE3 pass over the table", "blake3"),
    ("the changed bytes raw + a commit file", "raw_changed"),
)


def figure_of(runs: dict[str, dict[str, Any]]) -> Any:
    """Per run (its label -> its results), each `BARS` measure's median as a fraction of the
    run's median full save, whiskers its fastest and slowest step, beside the time floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(10, 0.2 * len(BARS) * len(runs) + 1.8))
    height = 0.8 / len(runs)
    for k, (label, run) in enumerate(runs.items()):
        full = run["medians_s"]["full"]
        med = {**run["medians_s"], **run["limits"]["medians_s"]}
        spread = {**run["spread_s"], **run["limits"]["spread_s"]}
        y = np.arange(len(BARS))[::-1] + (len(runs) / 2 - k - 0.5) * height
        mids = [med[key] / full for _, key in BARS]
        lows = [m - spread[key][0] / full for m, (_, key) in zip(mids, BARS, strict=True)]
        highs = [spread[key][1] / full - m for m, (_, key) in zip(mids, BARS, strict=True)]
        ax.barh(y, mids, height=height * 0.9, xerr=[lows, highs], label=label)
    ax.axvline(FLOORS["durable"], color="black", ls="--", lw=1, label="floor (0.1x)")
    ax.set_yticks(np.arange(len(BARS))[::-1], [name for name, _ in BARS], fontsize=8)
    ax.set_xlabel("time / the run's full save (median; whiskers: fastest to slowest step)")
    ax.set_title("A 256 MiB table with 2% of its chunks changed: a later save against a full one")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return figure
