"""Incremental saves: a training loop that saves every step through the manager, where
most of the state never changes, side by side with full saves and with Orbax.

Two trees, each sharded over a (4, 2) mesh of 8 CPU devices:

- ``lora``: a frozen base (8 float32 leaves, ``--mib`` in all) plus adapters (2% of it)
  and their adamw moments (two more copies) that change every step;
- ``third``: 6 large leaves, 2 of which (a different pair each step) change.

Per step, the three contenders save the same state in an order that rotates, each waiting
until its step is committed: a ``CheckpointManager(incremental=True)``, the same manager
saving in full, and Orbax 0.12.8's async ``CheckpointManager`` (``StandardSave``). All keep
every step. Reported: bytes written per later save vs the bytes that changed, the save's
time to durable, the disk used by all steps, and a cold restore of the last step
(incremental vs full: one untimed restore of each, then 5 alternated rounds, each restore
with its files evicted and starting from recently freed memory, as in
``benchmarks/save_restore.py``).

Then the last step is promoted to a durable tier, incremental vs full: the incremental
manager's steps before it are promoted first (untimed: its base and the frozen leaves it
references are durable then, as in a run that promotes every step), and the full manager's
last step goes to an empty durable tier. Both fast roots are evicted from the page cache
first; 3 rounds, alternated, each removing the promoted step's durable copy afterwards.
The durable tier is a second local directory, not the moto S3 server the tests use: moto
parses every request in Python on the same cores, so a full step's promotion would measure
moto and flatter the ratio; a local copy measures what promotion itself reads, checks and
writes.

Floors (later saves): bytes written <= 1.1x the changed bytes; time to durable <= 0.2x a
full save's; disk of all steps <= 1.2x (base + steps x changed); restore of an incremental
step >= 0.9x the speed of a full one; promotion of the last step <= 0.2x a full step's.

Then the chunk-level scenario (`benchmarks/incremental_chunks.py`: a 256 MiB embedding
table changing in 2% of its chunks per step, saved with ``base=`` and in full, side by
side), whose figures go to ``benchmarks/results/incremental_chunks.json``.

    python benchmarks/incremental.py            # 1 GiB base, 10 steps; table 256 MiB, 7 steps
    python benchmarks/incremental.py --quick    # 32 MiB, 4 steps (smoke test)
    python benchmarks/incremental.py --chunks-only   # the chunk-level scenario alone
    python benchmarks/incremental.py --chunks-only --chunks-storage s3   # ... on moto S3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks import incremental_chunks
from benchmarks.common import (
    RESULTS,
    MiB,
    machine_info,
    markdown_table,
    recycle_memory,
    scratch_dir,
    utc_timestamp,
    write_results,
)
from benchmarks.save_restore import evict_tree

PACKAGES = ["ckptstore", "jax", "tensorstore", "orbax-checkpoint"]
RESTORE_ROUNDS = 5  # cold restores of the last step, alternated, after one untimed each
FLOORS = {"bytes": 1.1, "durable": 0.2, "disk": 1.2, "restore": 0.9, "promote": 0.2}


def sharded(rows: int, cols: int, seed: int) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    host = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    return jax.device_put(host, NamedSharding(mesh, P("x", "y")))


def lora(mib: int) -> Callable[[int], tuple[dict[str, Any], int]]:
    """The state at step s, and the bytes that changed since step s - 1."""
    cols = 1024
    rows = max(8, mib * MiB // 8 // 4 // cols // 8 * 8)
    base = {f"w{i}": sharded(rows, cols, i) for i in range(8)}
    arows = max(8, rows * 2 // 100 // 8 * 8)

    def at(step: int) -> tuple[dict[str, Any], int]:
        adapters = {f"a{i}": sharded(arows, cols, 1000 * step + i) for i in range(8)}
        mu = {k: v * 0.1 for k, v in adapters.items()}
        nu = {k: v * v for k, v in adapters.items()}
        state = {"base": base, "adapters": adapters, "opt": {"mu": mu, "nu": nu}}
        changed = sum(int(v.nbytes) for part in (adapters, mu, nu) for v in part.values())
        return state, changed

    return at


def third(mib: int) -> Callable[[int], tuple[dict[str, Any], int]]:
    cols = 1024
    rows = max(8, mib * MiB // 6 // 4 // cols // 8 * 8)
    leaves = {f"w{i}": sharded(rows, cols, i) for i in range(6)}

    def at(step: int) -> tuple[dict[str, Any], int]:
        for i in ((2 * step) % 6, (2 * step + 1) % 6):
            leaves[f"w{i}"] = sharded(rows, cols, 100 * step + i)
        return dict(leaves), 2 * int(leaves["w0"].nbytes)

    return at


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def promote_last(root: Path, steps: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds to promote step ``steps`` of each manager's root to a local durable tier
    (module docstring), and the bytes each promotion copied."""
    tiers = {
        who: ckptstore.Tiered(str(root / who), str(root / f"durable-{who}"))
        for who in ("incremental", "full")
    }
    for step in range(1, steps):  # the incremental step's bases, durable first
        ckptstore.promote_sync(tiers["incremental"], step=step)
    seconds: dict[str, list[float]] = {"incremental": [], "full": []}
    copied: dict[str, int] = {}
    for rep in range(3):
        for who in ("incremental", "full") if rep % 2 == 0 else ("full", "incremental"):
            evict_tree(root / who)
            start = time.perf_counter()
            (done,) = ckptstore.promote_sync(tiers[who], step=steps)
            seconds[who].append(time.perf_counter() - start)
            assert not done.bases, done.bases  # its base was durable already
            copied[who] = done.bytes + done.held_bytes
            shutil.rmtree(root / f"durable-{who}" / str(steps))
    return seconds, copied


def run_tree(
    name: str, make: Callable[[int], tuple[dict[str, Any], int]], steps: int, root: Path
) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    options = {
        mode: ckptstore.ManagerOptions(
            handle_sigterm=False, gc_on_start=False, incremental=mode == "incremental"
        )
        for mode in ("incremental", "full")
    }
    managers = {m: ckptstore.CheckpointManager(root / m, options=o) for m, o in options.items()}
    orbax = ocp.CheckpointManager(
        root / "orbax", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    written: dict[str, list[int]] = {"incremental": [], "full": []}
    durable: dict[str, list[float]] = {"incremental": [], "full": [], "orbax": []}
    changed: list[int] = []
    total = 0
    try:
        for step in range(1, steps + 1):
            state, delta = make(step)
            state = jax.block_until_ready(state)
            total = sum(int(x.nbytes) for x in jax.tree.leaves(state))
            changed.append(delta)
            order = ["incremental", "full", "orbax"]
            order = order[step % 3 :] + order[: step % 3]
            for who in order:
                start = time.perf_counter()
                if who == "orbax":
                    orbax.save(step, args=ocp.args.StandardSave(state))
                    orbax.wait_until_finished()
                else:
                    handle = managers[who].save(step, state)
                    assert handle is not None
                    stats = handle.wait()
                    written[who].append(stats.bytes_written)
                durable[who].append(time.perf_counter() - start)
            del state
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            make(steps)[0],
        )
        restores: dict[str, list[float]] = {"incremental": [], "full": []}
        for who in ("incremental", "full"):  # untimed: the process's first restore of each
            jax.block_until_ready(managers[who].restore(steps, like=like))
        for rep in range(RESTORE_ROUNDS):
            for who in ("incremental", "full") if rep % 2 == 0 else ("full", "incremental"):
                evict_tree(root / who)
                recycle_memory(2 * total)  # each restore starts from recently freed memory
                start = time.perf_counter()
                got = jax.block_until_ready(managers[who].restore(steps, like=like))
                restores[who].append(time.perf_counter() - start)
                del got  # freeing what a restore returns is not part of it
        disk = {who: du(root / who) for who in ("incremental", "full", "orbax")}
    finally:
        for mgr in managers.values():
            mgr.close()
        orbax.close()
    promotions, promoted_bytes = promote_last(root, steps)
    base = total - changed[0]
    later = slice(1, None)
    med = {k: statistics.median(v[later]) for k, v in durable.items()}
    ratio_bytes = max(w / c for w, c in zip(written["incremental"][1:], changed[1:], strict=True))
    ratio_durable = med["incremental"] / med["full"]
    ideal_disk = base + steps * changed[0]
    ratio_disk = disk["incremental"] / ideal_disk
    rest = {k: statistics.median(v) for k, v in restores.items()}
    ratio_restore = rest["full"] / rest["incremental"]
    prom = {k: statistics.median(v) for k, v in promotions.items()}
    ratio_promote = prom["incremental"] / prom["full"]
    return {
        "tree": name,
        "state_bytes": total,
        "changed_bytes_per_step": changed,
        "bytes_written": written,
        "durable_s": durable,
        "restore_s": restores,
        "disk_bytes": disk,
        "promote_s": promotions,
        "promoted_bytes": promoted_bytes,
        "ratios": {
            "bytes_written_vs_changed": round(ratio_bytes, 4),
            "durable_vs_full": round(ratio_durable, 4),
            "durable_vs_orbax": round(med["incremental"] / med["orbax"], 4),
            "disk_vs_base_plus_changes": round(ratio_disk, 4),
            "restore_speed_vs_full": round(ratio_restore, 4),
            "promote_vs_full": round(ratio_promote, 4),
        },
        "floors": {
            "bytes": ratio_bytes <= FLOORS["bytes"],
            "durable": ratio_durable <= FLOORS["durable"],
            "disk": ratio_disk <= FLOORS["disk"],
            "restore": ratio_restore >= FLOORS["restore"],
            "promote": ratio_promote <= FLOORS["promote"],
        },
        "medians_s": {
            **{f"durable_{k}": round(v, 4) for k, v in med.items()},
            **{f"restore_{k}": round(v, 4) for k, v in rest.items()},
            **{f"promote_{k}": round(v, 4) for k, v in prom.items()},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mib", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--no-write-results", action="store_true")
    parser.add_argument("--chunks-mib", type=int, help="the chunk scenario's table (256)")
    parser.add_argument("--chunks-steps", type=int, help="its later saves (7; >= 5 timed)")
    parser.add_argument("--chunks-only", action="store_true")
    parser.add_argument("--chunks-storage", choices=("local", "s3"), default="local")
    parser.add_argument("--chunks-out", type=Path, help="its results file")
    args = parser.parse_args()
    mib = args.mib or (32 if args.quick else 1024)
    steps = args.steps or (4 if args.quick else 10)
    results = []
    chunked: dict[str, Any] | None = None
    with scratch_dir("ckptstore-bench-incremental-") as scratch:
        print(f"scratch directory: {scratch}", flush=True)
        for name, tree in (("lora", lora), ("third", third)):
            if args.chunks_only:  # the trees are not even built (lora's needs 8 devices)
                break
            root = scratch / name
            results.append(run_tree(name, tree(mib), steps, root))
            shutil.rmtree(root, ignore_errors=True)
        chunk_mib = args.chunks_mib or (8 if args.quick else 256)
        chunk_steps = args.chunks_steps or (3 if args.quick else 7)
        if args.chunks_storage == "local":
            storage = incremental_chunks.Storage(scratch / "chunks")
            chunked = incremental_chunks.run(chunk_mib, chunk_steps, storage)
        else:
            with incremental_chunks.moto_storage(scratch / "chunks") as storage:
                chunked = incremental_chunks.run(chunk_mib, chunk_steps, storage)
    rows = []
    for r in results:
        q = r["ratios"]
        f = r["floors"]
        rows += [
            [
                r["tree"],
                "bytes written / changed (later saves)",
                f"{q['bytes_written_vs_changed']}x",
                f"<= {FLOORS['bytes']}x",
                "PASS" if f["bytes"] else "FAIL",
            ],
            [
                r["tree"],
                "time to durable / full save",
                f"{q['durable_vs_full']}x",
                f"<= {FLOORS['durable']}x",
                "PASS" if f["durable"] else "FAIL",
            ],
            [r["tree"], "time to durable / Orbax", f"{q['durable_vs_orbax']}x", "-", "info"],
            [
                r["tree"],
                "disk / (base + steps x changed)",
                f"{q['disk_vs_base_plus_changes']}x",
                f"<= {FLOORS['disk']}x",
                "PASS" if f["disk"] else "FAIL",
            ],
            [
                r["tree"],
                "restore speed / full step's",
                f"{q['restore_speed_vs_full']}x",
                f">= {FLOORS['restore']}x",
                "PASS" if f["restore"] else "FAIL",
            ],
            [
                r["tree"],
                "promotion of the last step / full step's",
                f"{q['promote_vs_full']}x",
                f"<= {FLOORS['promote']}x",
                "PASS" if f["promote"] else "FAIL",
            ],
        ]
    rows += incremental_chunks.rows_of(chunked)
    print(f"\n{mib} MiB state, {steps} steps; table {chunk_mib} MiB, {chunk_steps} steps\n")
    print(markdown_table(["tree", "measure", "ratio", "floor", "verdict"], rows))
    failed = [f"{r['tree']}.{k}" for r in results for k, ok in r["floors"].items() if not ok]
    failed += [f"chunks.{k}" for k, ok in chunked["floors"].items() if not ok]
    print("floors:", "all pass" if not failed else "FAILED: " + ", ".join(failed))
    chunks_suffix = "" if args.chunks_storage == "local" else f"_{args.chunks_storage}"
    if not args.no_write_results:
        write_results(
            args.chunks_out or RESULTS / f"incremental_chunks{chunks_suffix}.json",
            {
                "benchmark": "incremental_chunks",
                "when": utc_timestamp(),
                "machine": machine_info(PACKAGES),
                "mib": chunk_mib,
                "steps": chunk_steps,
                **chunked,
            },
        )
    if not args.no_write_results and results:
        write_results(
            RESULTS / "incremental.json",
            {
                "benchmark": "incremental",
                "when": utc_timestamp(),
                "machine": machine_info(PACKAGES),
                "mib": mib,
                "steps": steps,
                "trees": results,
                "failed_floors": failed,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
