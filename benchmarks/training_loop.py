"""Training-loop benchmark: ckptstore's `CheckpointManager` vs Orbax's async `CheckpointManager`.

Workload: a ~1 GiB state (params and an optimizer moment, 8 + 8 float32 leaves) sharded
over a (4, 2) mesh of 8 CPU devices, and a jitted training step that donates it. Both
managers are configured as their users run them: Orbax 0.12.8
``CheckpointManager(enable_async_checkpointing=True)`` with ``args.StandardSave``,
ckptstore ``CheckpointManager`` with its defaults (fsync on; staging "auto", which on CPU
devices holds zero-copy views of the arrays' buffers) and with ``staging="host"`` (a copy
into reused host buffers before ``save`` returns, the accelerator path); all keep one step.

Per repetition, for each library (the first one alternates):

- host copy: ``jax.device_get(state)``, a plain copy of the state into new host memory;
- pause: the ``save()`` call, then three training steps timed while the save runs in
  the background (their mean against three steps without a save: the slowdown), then wait;
  "loop time lost" is the pause plus the three steps' extra time;
- durable: ``save()`` and wait at once, from the call until the step is committed.

Floors: pause <= Orbax's pause, pause <= 1.2x a host copy, durable <= 0.5x Orbax's.

    python benchmarks/training_loop.py           # ~1 GiB, 5 reps
    python benchmarks/training_loop.py --quick   # 64 MiB, 2 reps (smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
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
    Stats,
    machine_info,
    markdown_table,
    scratch_dir,
    utc_timestamp,
    write_results,
)
from ckptstore import policies

PACKAGES = ["ckptstore", "jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint"]
STEPS_TIMED = 3


def make_state(total_bytes: int) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    per_leaf = total_bytes // 16
    rows = max(8, per_leaf // (4 * 1024) // 8 * 8)
    make = jax.jit(
        lambda k: jax.random.normal(k, (rows, 1024), dtype=np.float32), out_shardings=sharding
    )
    keys = jax.random.split(jax.random.key(0), 16)
    return {
        "params": {f"layer{i}": make(keys[i]) for i in range(8)},
        "mu": {f"layer{i}": make(keys[8 + i]) for i in range(8)},
    }


@jax.jit
def _update(state: dict[str, Any]) -> dict[str, Any]:
    mu = jax.tree.map(lambda m, p: 0.9 * m + 0.1 * p, state["mu"], state["params"])
    params = jax.tree.map(lambda p, m: p - 1e-3 * m, state["params"], mu)
    return {"params": params, "mu": mu}


train_step = jax.jit(_update.__wrapped__, donate_argnums=0)  # type: ignore[attr-defined]


class Contender:
    """One library's manager over the same training loop."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root
        self.step = 0
        if name.startswith("ckptstore"):
            staging = "host" if name == "ckptstore-host" else "auto"
            self.mgr: Any = ckptstore.CheckpointManager(
                str(root),
                keep_policy=policies.KeepLatest(1),
                options=ckptstore.ManagerOptions(
                    handle_sigterm=False, gc_on_start=False, staging=staging
                ),
            )
            self._handle: Any = None
        else:
            import orbax.checkpoint as ocp

            self.ocp = ocp
            self.mgr = ocp.CheckpointManager(
                root,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=1, enable_async_checkpointing=True
                ),
            )

    def save(self, state: Any) -> None:
        self.step += 1
        if self.name.startswith("ckptstore"):
            self._handle = self.mgr.save(self.step, state)
        else:
            self.mgr.save(self.step, args=self.ocp.args.StandardSave(state))

    def wait(self) -> None:
        if self.name.startswith("ckptstore"):
            self._handle.wait()
        else:
            self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_steps(state: Any, n: int) -> tuple[Any, float]:
    """``n`` training steps; the state and the mean seconds per step."""
    start = time.perf_counter()
    for _ in range(n):
        state = train_step(state)
        jax.block_until_ready(state)
    return state, (time.perf_counter() - start) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 reps (smoke test)")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--no-write-results", action="store_true")
    args = parser.parse_args()
    nbytes = (64 if args.quick else 1024) * MiB
    reps = args.reps or (2 if args.quick else 5)

    state = make_state(nbytes)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    state, _ = run_steps(state, 2)  # compile
    names = ["ckptstore", "ckptstore-host", "orbax"]
    stats: dict[str, dict[str, Stats]] = {
        n: {k: Stats() for k in ("host_copy", "pause", "durable", "step", "step_during_save")}
        for n in names
    }
    with scratch_dir("ckptstore-bench-loop-") as scratch:
        print(f"scratch directory: {scratch}")
        contenders = {n: Contender(n, scratch / n) for n in names}
        try:
            for c in contenders.values():  # first-save costs (compilation, imports) untimed
                c.save(state)
                c.wait()
            for rep in range(reps):
                for k in range(len(names)):
                    name = names[(rep + k) % len(names)]
                    c, s = contenders[name], stats[name]
                    s["host_copy"].runs.append(timed(lambda st=state: jax.device_get(st)))
                    state, plain = run_steps(state, STEPS_TIMED)
                    s["step"].runs.append(plain)
                    s["pause"].runs.append(timed(lambda c=c, st=state: c.save(st)))
                    state, during = run_steps(state, STEPS_TIMED)
                    s["step_during_save"].runs.append(during)
                    c.wait()
                    s["durable"].runs.append(timed(lambda c=c, st=state: (c.save(st), c.wait())))
                    state, _ = run_steps(state, 1)
                print(f"rep {rep + 1}/{reps} done", flush=True)
        finally:
            for c in contenders.values():
                c.close()

    ck, ob = stats["ckptstore"], stats["orbax"]
    med = {n: {k: v.median for k, v in stats[n].items()} for n in names}
    host = statistics.median(ck["host_copy"].runs + ob["host_copy"].runs)
    rows, floors = [], []

    def row(what: str, value: float, base_name: str, base: float, floor: float | None) -> None:
        ratio = value / base
        verdict = "info" if floor is None else ("PASS" if ratio <= floor else "FAIL")
        if verdict == "FAIL":
            floors.append(what)
        rows.append(
            [
                what,
                f"{value * 1e3:.1f} ms",
                base_name,
                f"{base * 1e3:.1f} ms",
                f"{ratio:.2f}x",
                "-" if floor is None else f"<= {floor}x",
                verdict,
            ]
        )

    row("pause per save", med["ckptstore"]["pause"], "Orbax pause", med["orbax"]["pause"], 1.0)
    row("pause per save", med["ckptstore"]["pause"], "host copy", host, 1.2)
    row("Orbax pause", med["orbax"]["pause"], "host copy", host, None)
    row("host-staging pause", med["ckptstore-host"]["pause"], "host copy", host, 1.2)
    row("save to durable", med["ckptstore"]["durable"], "Orbax", med["orbax"]["durable"], 0.5)
    row(
        "host-staging durable",
        med["ckptstore-host"]["durable"],
        "Orbax",
        med["orbax"]["durable"],
        None,
    )
    for n in names:
        row(
            f"{n}: step during a save",
            med[n]["step_during_save"],
            "step alone",
            med[n]["step"],
            None,
        )
    lost = {  # what a save costs the loop: its pause plus the slowdown of the next steps
        n: med[n]["pause"] + STEPS_TIMED * max(0.0, med[n]["step_during_save"] - med[n]["step"])
        for n in names
    }
    for n in ("ckptstore", "ckptstore-host"):
        row(f"{n}: loop time lost per save", lost[n], "Orbax", lost["orbax"], None)
    table = markdown_table(
        ["measure", "value", "baseline", "baseline value", "ratio", "floor", "verdict"], rows
    )
    print(f"\nstate {nbytes / MiB:.0f} MiB on 8 CPU devices, {reps} reps, medians\n")
    print(table)
    spread = {
        n: {k: [round(min(v.runs) * 1e3, 1), round(max(v.runs) * 1e3, 1)] for k, v in s.items()}
        for n, s in stats.items()
    }
    print("\nspread (min-max ms):", spread)
    print("floors:", "all pass" if not floors else "FAILED: " + ", ".join(floors))
    if not args.no_write_results:
        write_results(
            RESULTS / "training_loop.json",
            {
                "benchmark": "training_loop",
                "when": utc_timestamp(),
                "machine": machine_info(PACKAGES),
                "state_bytes": nbytes,
                "reps": reps,
                "runs_s": {n: {k: v.runs for k, v in s.items()} for n, s in stats.items()},
                "medians_s": med,
                "host_copy_median_s": host,
                "table": table,
                "failed_floors": floors,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
