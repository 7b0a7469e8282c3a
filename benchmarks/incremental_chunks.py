"""The chunk-level scenario of `benchmarks/incremental.py`: a sparsely updated embedding table.

A float32 table (``--chunks-mib``, 256 MiB by default: 65536 x 1024), sharded by rows over 8
CPU devices and stored in chunks of ``CHUNK_BYTES`` (2,048 chunks at 256 MiB), changes in
``FRACTION`` of its chunks per step (one element each, chunks drawn at random). Each step
is saved twice, side by side, in an order that alternates: ``save(base=previous step)``
into one root and a full save into another (both `save_sync`, which returns once the step
is committed: its time to durable). Reported, over the later steps: bytes written per
incremental save against the table's, the median (and spread) of both saves' times; each
incremental step restores bit-exact; then the base (step 1) and every step but the last
are deleted, `gc` runs with no grace, and every step still listed restores bit-exact.

Floors: bytes written <= 3% of the table's; time to durable <= 0.1x a full save's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks.common import MiB
from ckptstore.format.digests import digest

CHUNK_BYTES = 128 << 10
FRACTION = 0.02
FLOORS = {"bytes": 0.03, "durable": 0.1}


def _sharded(host: np.ndarray[Any, Any]) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    return jax.device_put(host, NamedSharding(mesh, P("x", None)))


def _touch(host: np.ndarray[Any, Any], rng: np.random.Generator, chunk: tuple[int, ...]) -> None:
    """Change one element in each of `FRACTION` of the table's chunks, in place."""
    grid = [-(-n // c) for n, c in zip(host.shape, chunk, strict=True)]
    count = max(1, int(FRACTION * grid[0] * grid[1]))
    for linear in rng.choice(grid[0] * grid[1], size=count, replace=False):
        r, c = divmod(int(linear), grid[1])
        host[r * chunk[0], c * chunk[1]] += 1.0


def run(mib: int, steps: int, root: Path) -> dict[str, Any]:
    """The scenario (module docstring) below ``root``; its figures and floors."""
    rows = max(64, mib * MiB // 4 // 1024 // 64 * 64)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((rows, 1024), dtype=np.float32)
    roots = {"incremental": str(root / "incremental"), "full": str(root / "full")}
    first = ckptstore.save_sync(
        roots["incremental"], {"t": _sharded(host)}, step=1, chunk_bytes=CHUNK_BYTES
    )
    ckptstore.save_sync(roots["full"], {"t": _sharded(host)}, step=1, chunk_bytes=CHUNK_BYTES)
    chunk = (
        ckptstore.read_manifest_sync(roots["incremental"], 1).items["state"].leaves["t"].chunk_shape
    )
    durable: dict[str, list[float]] = {"incremental": [], "full": []}
    written: list[int] = []
    kept: dict[int, str] = {}  # each step's table, as its digest (copies would cost GiBs)
    for step in range(2, steps + 2):
        _touch(host, rng, chunk)
        tree = {"t": _sharded(host)}
        jax.block_until_ready(tree)
        for who in ("incremental", "full") if step % 2 == 0 else ("full", "incremental"):
            start = time.perf_counter()
            base = step - 1 if who == "incremental" else None
            result = ckptstore.save_sync(
                roots[who], tree, step=step, base=base, chunk_bytes=CHUNK_BYTES
            )
            durable[who].append(time.perf_counter() - start)
            if who == "incremental":
                written.append(result.bytes_written)
        kept[step] = digest(host)
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
        "ratios": {
            "bytes_written_vs_table": round(ratio_bytes, 4),
            "durable_vs_full": round(ratio_durable, 4),
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


def rows_of(r: dict[str, Any]) -> list[list[str]]:
    """The scenario's lines of the benchmark's table."""
    q, f, m, s = r["ratios"], r["floors"], r["medians_s"], r["spread_s"]
    verdict = {k: "PASS" if ok else "FAIL" for k, ok in f.items()}
    inc, full = s["incremental"], s["full"]
    spread = (
        f"inc {m['incremental']} s [{inc[0]}-{inc[1]}], full {m['full']} s [{full[0]}-{full[1]}]"
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
            "bit-exact restores, also after base deleted + gc",
            "-",
            "all",
            verdict["restore"],
        ],
    ]
