"""Training-loop benchmark: ckptstore's `CheckpointManager` vs Orbax's async `CheckpointManager`.

Workload: a ~1 GiB state (params and an optimizer moment, 8 + 8 float32 leaves) sharded
over a (4, 2) mesh of 8 CPU devices, and a jitted training step that donates it. Both
managers are configured as their users run them: Orbax 0.12.8
``CheckpointManager(enable_async_checkpointing=True)`` with ``args.StandardSave``,
ckptstore ``CheckpointManager`` with ``staging="view"`` (fsync on; zero-copy views of
the arrays' buffers, asked for) and with its defaults (staging "auto", which on CPU devices
is ``"host"``: a copy into reused host buffers before ``save`` returns, since an array there
may share memory with a numpy buffer); all keep one step.
Orbax's default compresses each array chunk with zstd level 1 (zarr2's ``{"id": "zstd",
"level": 1}``); ckptstore writes raw bytes. So Orbax also runs with its compression off
("orbax-nocomp": the same async manager with a ``PyTreeCheckpointHandler(use_compression=False)``
in its ``handler_registry`` and ``args.PyTreeSave``: ``StandardCheckpointHandler`` is that
handler with its compression on and a check of the tree, and takes no ``use_compression``).

Per repetition, for each library (the first one alternates):

- host copy: ``jax.device_get(state)``, a plain copy of the state into new host memory;
- pause: the ``save()`` call, then three training steps timed while the save runs in
  the background (their mean against three steps without a save: the slowdown), then the
  library's own "wait for everything" (``wait_until_finished``); "loop time lost" is the
  pause plus the three steps' extra time;
- durable: ``save()`` and wait at once; from the call until the step is committed. Orbax's
  ``wait_until_finished`` also deletes the old step (``max_to_keep``) after the commit, so
  its commit time is taken where its finalize thread has committed the step, before that
  deletion (``_finalize_checkpoint``); ckptstore's is when ``handle.wait()`` returns (its
  keep policy runs after the commit too). Both then finish (old step deleted) before the
  next measurement, so no library's deletion runs beside another's save; "save to
  finished" (commit plus deleting the old step) is reported too.

Each repetition also times ``dd bs=16M oflag=direct conv=fsync`` of as many bytes (the
disk's durable write speed, reported beside the saves: the least any durable save takes).

Floors: pause <= Orbax's pause, pause <= 1.2x a host copy, durable <= 0.5x Orbax's, on
the 1 GiB state and on a 192 MiB one (``--mib 192``; `make bench` runs both).

    python benchmarks/training_loop.py           # ~1 GiB, 5 reps
    python benchmarks/training_loop.py --mib 192 # a small state, where fixed costs show
    python benchmarks/training_loop.py --quick   # 64 MiB, 2 reps (smoke test)
    python benchmarks/training_loop.py --mib 256 --reps 3 --no-write-results  # while iterating
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
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
#: ckptstore's own breakdown of each "durable" save (`SaveStats`), reported beside the table.
PHASES = ("staging", "write", "merge", "commit", "durable")


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
        self.started = 0.0  # when the last save() was called
        self.committed = 0.0  # when Orbax's finalize thread committed the last step
        self.phases: dict[str, list[float]] = {}  # ckptstore: SaveStats of the durable saves
        if name.startswith("ckptstore"):
            staging = "auto" if name == "ckptstore-host" else "view"  # "auto" is "host" here
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

            from benchmarks.save_restore import orbax_manager  # its module sets JAX's flags

            self.ocp = ocp
            self.mgr = orbax_manager(root, compress=name != "orbax-nocomp")
            # A measuring probe only: Orbax commits the step, then (same thread) deletes the
            # steps max_to_keep drops; the time between the two is when the step is durable.
            finalize = self.mgr._finalize_checkpoint

            def finalize_and_note(step: int) -> Any:
                out = finalize(step)
                self.committed = time.perf_counter()
                return out

            self.mgr._finalize_checkpoint = finalize_and_note

    def save(self, state: Any) -> None:
        self.step += 1
        self.started = time.perf_counter()
        if self.name.startswith("ckptstore"):
            self._handle = self.mgr.save(self.step, state)
        elif self.name == "orbax-nocomp":
            self.mgr.save(self.step, args=self.ocp.args.PyTreeSave(state))
        else:
            self.mgr.save(self.step, args=self.ocp.args.StandardSave(state))

    def wait_durable(self) -> float:
        """Wait until the last save is committed; seconds from its save() call until then."""
        if self.name.startswith("ckptstore"):
            stats = self._handle.wait()
            seconds = time.perf_counter() - self.started
            for phase in PHASES:
                self.phases.setdefault(phase, []).append(getattr(stats, phase))
            return seconds
        self.committed = 0.0
        self.mgr.wait_until_finished()
        assert self.committed > self.started, "Orbax's finalize probe did not run"
        return self.committed - self.started

    def compressor(self) -> Any:
        """The compressor in the zarr metadata of the last step's first leaf (None: raw)."""
        if self.name.startswith("ckptstore"):
            return None  # ckptstore writes the arrays' bytes as they are
        import tensorstore as ts

        item = self.root / str(self.step) / "default"
        kvstore = {"driver": "ocdbt", "base": f"file://{item}", "path": "params.layer0"}
        array = ts.open({"driver": "zarr", "kvstore": kvstore}).result()
        return array.spec().to_json()["metadata"].get("compressor")

    def finish(self) -> None:
        """The library's own wait for everything in the background (old steps deleted)."""
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()


def _dd(source: Path, target: Path) -> None:
    """``dd`` of ``source`` to ``target`` with O_DIRECT and an fsync, then ``target`` goes."""
    cmd = ["dd", f"if={source}", f"of={target}", "bs=16M", "oflag=direct", "conv=fsync"]
    subprocess.run([*cmd, "status=none"], check=True)
    target.unlink()


def _median(value: Stats | float) -> float:
    return value.median if isinstance(value, Stats) else value


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
    parser.add_argument("--mib", type=int, help="state size in MiB (default 1024; --quick 64)")
    parser.add_argument("--no-write-results", action="store_true")
    parser.add_argument(
        "--output",
        type=Path,
        help="results file (default results/training_loop.json for 1 GiB, "
        "results/training_loop_<MiB>mib.json for other sizes)",
    )
    args = parser.parse_args()
    mib = args.mib or (64 if args.quick else 1024)
    nbytes = mib * MiB
    reps = args.reps or (2 if args.quick else 5)

    # Orbax's save() warns that "waiting for the previous save" took long: it counts the
    # explicit wait_until_finished() calls this benchmark makes between saves.
    logging.getLogger("absl").setLevel(logging.ERROR)
    machine = machine_info(PACKAGES)  # the load average before the run
    state = make_state(nbytes)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    state, _ = run_steps(state, 2)  # compile
    names = ["ckptstore", "ckptstore-host", "orbax", "orbax-nocomp"]
    stats: dict[str, dict[str, Stats]] = {
        n: {
            k: Stats()
            for k in ("host_copy", "pause", "durable", "finished", "step", "step_during_save")
        }
        for n in names
    }
    dd = Stats()  # the disk's own speed for as many bytes, durably: what a save can reach
    with scratch_dir("ckptstore-bench-loop-") as scratch:
        print(f"scratch directory: {scratch}")
        source = scratch / "dd_source.bin"
        with open(source, "wb") as f:
            f.write(np.random.default_rng(0).bytes(nbytes))
        contenders = {n: Contender(n, scratch / n) for n in names}
        try:
            for c in contenders.values():  # first-save costs (compilation, imports) untimed
                c.save(state)
                c.finish()
            compression = {n: c.compressor() for n, c in contenders.items()}
            print("compression (zarr compressor as written):", compression)
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
                    c.finish()
                    c.save(state)
                    s["durable"].runs.append(c.wait_durable())
                    c.finish()
                    s["finished"].runs.append(time.perf_counter() - c.started)
                    state, _ = run_steps(state, 1)
                dd.runs.append(timed(lambda: _dd(source, scratch / "dd_target.bin")))
                print(f"rep {rep + 1}/{reps} done", flush=True)
        finally:
            for c in contenders.values():
                c.close()

    med = {n: {k: v.median for k, v in stats[n].items()} for n in names}
    host = Stats([r for n in names for r in stats[n]["host_copy"].runs])
    rows, floors = [], []

    def ms(value: Stats | float) -> str:
        if isinstance(value, float):
            return f"{value * 1e3:.1f} ms"
        return f"{value.median * 1e3:.1f} ms ({value.min * 1e3:.0f}-{value.max * 1e3:.0f})"

    def row(
        what: str, value: Stats | float, base_name: str, base: Stats | float, floor: float | None
    ) -> None:
        ratio = _median(value) / _median(base)
        verdict = "info" if floor is None else ("PASS" if ratio <= floor else "FAIL")
        if verdict == "FAIL":
            floors.append(what)
        floor_text = "-" if floor is None else f"<= {floor}x"
        rows.append([what, ms(value), base_name, ms(base), f"{ratio:.2f}x", floor_text, verdict])

    ck, ckh, ob = stats["ckptstore"], stats["ckptstore-host"], stats["orbax"]
    on = stats["orbax-nocomp"]  # Orbax with its compression off: raw bytes, as ckptstore's
    nc = "Orbax uncompressed"
    row("pause per save", ck["pause"], "Orbax pause", ob["pause"], 1.0)
    row("pause per save", ck["pause"], f"{nc} pause", on["pause"], None)
    row("pause per save", ck["pause"], "host copy", host, 1.2)
    row("Orbax pause", ob["pause"], "host copy", host, None)
    row(f"{nc} pause", on["pause"], "host copy", host, None)
    row("host-staging pause", ckh["pause"], "host copy", host, 1.2)
    row("save to durable", ck["durable"], "Orbax", ob["durable"], 0.5)
    row("save to durable", ck["durable"], nc, on["durable"], None)
    row("host-staging durable", ckh["durable"], "Orbax", ob["durable"], None)
    row("host-staging durable", ckh["durable"], nc, on["durable"], None)
    row("save to durable", ck["durable"], "dd direct+fsync", dd, 1.1)  # the disk's own limit
    row("dd direct+fsync of the state's bytes", dd, "Orbax", ob["durable"], None)
    row("dd direct+fsync of the state's bytes", dd, nc, on["durable"], None)
    row("save to finished (old step deleted)", ck["finished"], "Orbax", ob["finished"], None)
    row("save to finished (old step deleted)", ck["finished"], nc, on["finished"], None)
    for n in names:
        during, alone = stats[n]["step_during_save"], stats[n]["step"]
        row(f"{n}: step during a save", during, "step alone", alone, None)
    lost = {  # what a save costs the loop: its pause plus the slowdown of the next steps
        n: med[n]["pause"] + STEPS_TIMED * max(0.0, med[n]["step_during_save"] - med[n]["step"])
        for n in names
    }
    for n in ("ckptstore", "ckptstore-host"):
        row(f"{n}: loop time lost per save", lost[n], "Orbax", lost["orbax"], None)
        row(f"{n}: loop time lost per save", lost[n], nc, lost["orbax-nocomp"], None)
    table = markdown_table(
        [
            "measure",
            "median (min-max)",
            "baseline",
            "baseline median (min-max)",
            "ratio",
            "floor",
            "verdict",
        ],
        rows,
    )
    print(f"\nstate {nbytes / MiB:.0f} MiB on 8 CPU devices, {reps} reps, medians\n")
    print(table)
    spread = {
        n: {k: [round(min(v.runs) * 1e3, 1), round(max(v.runs) * 1e3, 1)] for k, v in s.items()}
        for n, s in stats.items()
    }
    print("\nspread (min-max ms):", spread)
    phases = {
        n: {k: round(statistics.median(v), 4) for k, v in contenders[n].phases.items()}
        for n in ("ckptstore", "ckptstore-host")
    }
    print("ckptstore's own breakdown of its durable saves (SaveStats medians, s):", phases)
    print("floors:", "all pass" if not floors else "FAILED: " + ", ".join(floors))
    if not args.no_write_results:
        write_results(
            args.output
            or RESULTS / ("training_loop.json" if mib == 1024 else f"training_loop_{mib}mib.json"),
            {
                "benchmark": "training_loop",
                "when": utc_timestamp(),
                "machine": machine,
                "load_avg_at_end": list(os.getloadavg()),
                "state_bytes": nbytes,
                "reps": reps,
                "runs_s": {n: {k: v.runs for k, v in s.items()} for n, s in stats.items()},
                "medians_s": med,
                "host_copy_median_s": host.median,
                "loop_time_lost_s": lost,
                "compression": compression,
                "dd_direct_fsync_s": dd.runs,
                "ckptstore_phases_median_s": phases,
                "table": table,
                "failed_floors": floors,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
