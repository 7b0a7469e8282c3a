"""The chunk-level scenario of `benchmarks/incremental.py`: a sparsely updated embedding table.

A float32 table (``--chunks-mib``, 256 MiB by default: 65536 x 1024), sharded by rows over 8
CPU devices and stored in chunks of ``CHUNK_BYTES`` (2,048 chunks at 256 MiB), changes in
``FRACTION`` of its chunks per step (one element each, chunks drawn at random). Each step
is saved twice, side by side, in an order that alternates: ``save(base=previous step)``
into one root and a full save into another (both `save_sync`, which returns once the step
is committed: its time to durable). Between and after them, in an order that rotates,
what bounds the incremental save on this machine (`LIMITS`): the chunk digests of the table
as a save computes them (its `piece_table` of the pieces this process owns), one BLAKE3
pass over the table's bytes (its own threads), and the commit of a step that writes nothing
new (the previous step's very arrays saved again with ``base=`` it, vouched the same
objects as the manager does: nothing hashed, nothing written; deleted again, untimed), and a
full save of only the changed chunks' bytes (each changed chunk a leaf of its own, copied
out untimed, into a root of its own: what any save of this step must write and commit, with
its change detection free). The limit of a step is its digests plus that commit: a save
that finds the changed chunks by hashing cannot take less.

Reported, over the later steps: bytes written per incremental save against the table's, the
median (and spread) of both saves' times, of each limit and of the limit; each incremental
step restores bit-exact; then the base (step 1) and every step but the last are deleted,
`gc` runs with no grace, and every step still listed restores bit-exact.

Floors: bytes written <= 3% of the table's; time to durable <= 0.1x a full save's.
"""

from __future__ import annotations

import statistics
import time
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

CHUNK_BYTES = 128 << 10
FRACTION = 0.02
FLOORS = {"bytes": 0.03, "durable": 0.1}
#: What is timed beside the two saves: the table's chunk digests as a save computes them,
#: one BLAKE3 pass over its bytes, the commit of a step that writes nothing new, and a save of
#: only the changed chunks' bytes.
LIMITS = ("digests", "blake3", "nothing_new", "changed_only")
NOTHING_NEW = 10_000  # the nothing-new commits' steps: this plus the step they repeat
save_items_sync = blocking(save_items)


def _sharded(host: np.ndarray[Any, Any]) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    return jax.device_put(host, NamedSharding(mesh, P("x", None)))


def _touch(
    host: np.ndarray[Any, Any], rng: np.random.Generator, chunk: tuple[int, ...]
) -> dict[str, np.ndarray[Any, Any]]:
    """Change one element in each of `FRACTION` of the table's chunks, in place; the changed
    chunks' new values, one leaf each (copies)."""
    grid = [-(-n // c) for n, c in zip(host.shape, chunk, strict=True)]
    count = max(1, int(FRACTION * grid[0] * grid[1]))
    changed = {}
    for linear in rng.choice(grid[0] * grid[1], size=count, replace=False):
        r, c = divmod(int(linear), grid[1])
        host[r * chunk[0], c * chunk[1]] += 1.0
        region = host[r * chunk[0] : (r + 1) * chunk[0], c * chunk[1] : (c + 1) * chunk[1]]
        changed[f"chunk_{int(linear)}"] = region.copy()
    return changed


def run(mib: int, steps: int, root: Path) -> dict[str, Any]:
    """The scenario (module docstring) below ``root``; its figures and floors."""
    rows = max(64, mib * MiB // 4 // 1024 // 64 * 64)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((rows, 1024), dtype=np.float32)
    roots = {"incremental": str(root / "incremental"), "full": str(root / "full")}
    previous = {"t": _sharded(host)}  # the arrays of the step before: see `_nothing_new`
    first = ckptstore.save_sync(roots["incremental"], previous, step=1, chunk_bytes=CHUNK_BYTES)
    ckptstore.save_sync(roots["full"], {"t": _sharded(host)}, step=1, chunk_bytes=CHUNK_BYTES)
    chunk = (
        ckptstore.read_manifest_sync(roots["incremental"], 1).items["state"].leaves["t"].chunk_shape
    )
    durable: dict[str, list[float]] = {"incremental": [], "full": []}
    limits: dict[str, list[float]] = {k: [] for k in LIMITS}
    written: list[int] = []
    kept: dict[int, str] = {}  # each step's table, as its digest (copies would cost GiBs)
    for step in range(2, steps + 2):
        changed = _touch(host, rng, chunk)
        tree = {"t": _sharded(host)}
        jax.block_until_ready(tree)
        pair = ("incremental", "full") if step % 2 == 0 else ("full", "incremental")
        turn = step % len(LIMITS)
        others = LIMITS[turn:] + LIMITS[:turn]
        for who in (pair[0], others[0], pair[1], *others[1:]):
            start = time.perf_counter()
            if who in ("incremental", "full"):
                base = step - 1 if who == "incremental" else None
                result = ckptstore.save_sync(
                    roots[who], tree, step=step, base=base, chunk_bytes=CHUNK_BYTES
                )
                durable[who].append(time.perf_counter() - start)
                if who == "incremental":
                    written.append(result.bytes_written)
                continue
            if who == "digests":  # as `save(base=)` finds the changed chunks
                pieces = owned_slices(tree["t"], 0)
                run_on_loop(piece_table(pieces, host.shape, chunk, host.itemsize, {}))
            elif who == "blake3":
                blake3.blake3(host.reshape(-1).view(np.uint8), max_threads=blake3.blake3.AUTO)
            elif who == "changed_only":  # what this step must write, in a root of its own
                ckptstore.save_sync(str(root / "changed_only"), changed, step=step)
            else:  # the previous step again, with it as the base: nothing hashed or written
                again = _nothing_new(roots["incremental"], previous, step - 1)
            limits[who].append(time.perf_counter() - start)
            if who == "nothing_new":
                assert again.bytes_written == 0, again.bytes_written
                ckptstore.delete_step_sync(roots["incremental"], NOTHING_NEW + step - 1)
            if who == "changed_only":
                ckptstore.delete_step_sync(str(root / "changed_only"), step)
        kept[step] = digest(host)
        previous = tree
        del tree
    exact = all(
        digest(ckptstore.restore_sync(roots["incremental"], s)["t"]) == v for s, v in kept.items()
    )
    for step in range(1, steps + 1):  # the base and every step but the last
        ckptstore.delete_step_sync(roots["incremental"], step)
    ckptstore.gc_sync(roots["incremental"], older_than=0)
    last = steps + 1
    after_gc = ckptstore.list_steps_sync(roots["incremental"]) == [last] and (
        digest(ckptstore.restore_sync(roots["incremental"], last)["t"]) == kept[last]
    )
    verified = ckptstore.verify_sync(roots["incremental"], last).ok
    med = {k: statistics.median(v) for k, v in durable.items()}
    bound = [d + c for d, c in zip(limits["digests"], limits["nothing_new"], strict=True)]
    limit = statistics.median(bound)
    changed_only = statistics.median(limits["changed_only"])
    ratio_bytes = max(written) / host.nbytes
    ratio_durable = med["incremental"] / med["full"]
    return {
        "table_bytes": host.nbytes,
        "chunk_shape": list(chunk),
        "chunks": -(-rows // chunk[0]) * -(-1024 // chunk[1]),
        "changed_fraction": FRACTION,
        "full_save_bytes": first.bytes_written,
        "bytes_written": written,
        "durable_s": durable,
        "medians_s": {k: round(v, 4) for k, v in med.items()},
        "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in durable.items()},
        "limits": {
            "seconds": limits,
            "medians_s": {k: round(statistics.median(v), 4) for k, v in limits.items()},
            "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in limits.items()},
            "limit_s": bound,
            "limit_median_s": round(limit, 4),
            "limit_spread_s": [round(min(bound), 4), round(max(bound), 4)],
        },
        "ratios": {
            "bytes_written_vs_table": round(ratio_bytes, 4),
            "durable_vs_full": round(ratio_durable, 4),
            "limit_vs_full": round(limit / med["full"], 4),
            "changed_only_vs_full": round(changed_only / med["full"], 4),
            "durable_vs_limit": round(med["incremental"] / limit, 4),
        },
        "restored_bit_exact": exact,
        "restored_after_base_deleted_and_gc": after_gc,
        "verified_after_gc": verified,
        "floors": {
            "bytes": ratio_bytes <= FLOORS["bytes"],
            "durable": ratio_durable <= FLOORS["durable"],
            "restore": exact and after_gc and verified,
        },
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
        chunk_bytes=CHUNK_BYTES,
    )


def rows_of(r: dict[str, Any]) -> list[list[str]]:
    """The scenario's lines of the benchmark's table."""
    q, f, m, s = r["ratios"], r["floors"], r["medians_s"], r["spread_s"]
    verdict = {k: "PASS" if ok else "FAIL" for k, ok in f.items()}
    inc, full = s["incremental"], s["full"]
    spread = (
        f"inc {m['incremental']} s [{inc[0]}-{inc[1]}], full {m['full']} s [{full[0]}-{full[1]}]"
    )
    lim, lm = r["limits"], r["limits"]["medians_s"]
    parts = (
        f"digests {lm['digests']} s + nothing-new commit {lm['nothing_new']} s; "
        f"one BLAKE3 pass {lm['blake3']} s"
    )
    return [
        [
            "chunks",
            "bytes written / table (later saves)",
            f"{q['bytes_written_vs_table']}x",
            f"<= {FLOORS['bytes']}x",
            verdict["bytes"],
        ],
        [
            "chunks",
            f"time to durable / full save ({spread})",
            f"{q['durable_vs_full']}x",
            f"<= {FLOORS['durable']}x",
            verdict["durable"],
        ],
        [
            "chunks",
            f"limit / full save (limit {lim['limit_median_s']} s: {parts})",
            f"{q['limit_vs_full']}x",
            "-",
            "info",
        ],
        ["chunks", "time to durable / limit", f"{q['durable_vs_limit']}x", "-", "info"],
        [
            "chunks",
            f"a save of only the changed chunks / full save ({lm['changed_only']} s)",
            f"{q['changed_only_vs_full']}x",
            "-",
            "info",
        ],
        [
            "chunks",
            "bit-exact restores, also after base deleted + gc",
            "-",
            "all",
            verdict["restore"],
        ],
    ]
