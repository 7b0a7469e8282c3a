"""What only an accelerator can measure, prepared so that a few minutes on a GPU machine go
to running it, not writing it.

On the accelerators JAX finds (every GPU of the machine), with a state sharded over all of
them (float32 leaves of 64 MiB and one replicated 1 MiB leaf), interleaved, medians of
``--reps``:

1. **staging** (device to host): the pause of `CheckpointManager.save` with
   ``staging="host"`` (the copy into host buffers the save owns), against
   ``jax.device_get`` of the same state (a plain copy into new host memory: the
   hardware's device-to-host path) and against Orbax's async `CheckpointManager.save`
   (its pause). Floor: ckptstore's pause <= 1.2x ``device_get`` (as on CPU).
   Each measured operation gets a state it has not seen: the state is stepped on the
   devices (``x + 1``, donated) before each one, untimed, as a training loop's state is.
   A ``jax.Array`` keeps the host copy that ``device_get`` or ``np.asarray`` made of it, so
   copying the same arrays again measures a cache, not the device-to-host path.
2. **host buffer reuse**: the process's RSS growth over the first save and over each later
   one, each measured once the next training step has replaced the saved arrays (JAX keeps
   the host copy a transfer made on the array it made it of, until the array is freed);
   a later save must reuse the host buffers of the first (growth under 5% of the
   state), and its staging is timed apart from the first's.
3. **restore onto the devices**: `ckptstore.restore_sync` with ``like=`` the state's
   shardings, against Orbax's ``StandardCheckpointer().restore(target=...)`` onto the same
   shardings, each restore's files evicted from the page cache first. Floor: >= 1.5x Orbax.
   For information, the two halves a restore cannot avoid, timed in the same rounds:
   reading its files into new host memory (evicted first), and ``jax.device_put`` of the
   state from host memory onto the same shardings.

    python benchmarks/gpu.py                        # on the GPU machine: 4 GiB, 5 reps
    python benchmarks/gpu.py --mib 1024 --reps 3    # shorter
    python benchmarks/gpu.py --dry                  # CPU devices, 16 MiB, 2 reps (make test)

On the GPU machine: ``pip install --no-deps -e .`` (the image has JAX with CUDA,
TensorStore and Orbax), then ``python benchmarks/gpu.py --out $OUT/gpu.json``; the figures
are written to that JSON file and printed as a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if "--dry" in sys.argv:  # before JAX loads: 8 CPU devices stand in for the accelerators
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks import common
from benchmarks.save_restore import (
    evict_tree,
    files_below,
    orbax_restore,
    orbax_save,
    read_fresh,
)

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results" / "gpu.json"
STAGING_FLOOR = 1.2  # ckptstore's pause <= 1.2x device_get
RESTORE_FLOOR = 1.5  # ckptstore's restore >= 1.5x Orbax's
REUSE_FLOOR = 0.05  # a later save grows RSS by < 5% of the state


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_state(mib: int) -> dict[str, Any]:
    """``mib`` MiB of float32 leaves of 64 MiB (fewer when small), sharded over every
    device along their first axis, plus a replicated 1 MiB leaf."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("d",))
    leaf_mib = min(64, max(1, mib // 4))
    rows = len(devices) * 64
    cols = leaf_mib * MiB // 4 // rows
    sharded = NamedSharding(mesh, P("d", None))
    state: dict[str, Any] = {}
    for i in range(max(1, mib // leaf_mib)):
        host = np.random.default_rng(i).standard_normal((rows, cols), dtype=np.float32)
        state[f"w{i:03d}"] = jax.device_put(host, sharded)
    state["bias"] = jax.device_put(np.ones(MiB // 4, np.float32), NamedSharding(mesh, P()))
    return jax.block_until_ready(state)


def nbytes(state: dict[str, Any]) -> int:
    return sum(int(v.nbytes) for v in state.values())


def abstract(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        a[k].sharding == b[k].sharding and np.array_equal(np.asarray(a[k]), np.asarray(b[k]))
        for k in a
    )


def staging(state: dict[str, Any], root: Path, reps: int) -> dict[str, Any]:
    """The pause of a save (host staging) vs device_get vs Orbax's async save, and RSS."""
    import orbax.checkpoint as ocp

    size = nbytes(state)
    step_state = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
    state = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))  # ours to donate
    options = ckptstore.ManagerOptions(staging="host", handle_sigterm=False)
    keep = ckptstore.policies.KeepLatest(1)
    pauses: dict[str, list[float]] = {"ckptstore": [], "device_get": [], "orbax": []}
    growth: list[int] = []
    trace: list[tuple[str, int]] = []  # (operation, RSS after it): a leak grows here
    saved: int | None = None  # RSS before the last ckptstore save
    orbax_mgr = ocp.CheckpointManager(
        root / "orbax", options=ocp.CheckpointManagerOptions(max_to_keep=1)
    )
    with ckptstore.CheckpointManager(root / "ckptstore", keep_policy=keep, options=options) as mgr:
        for step in range(1, reps + 2):  # the first save (new buffers) is timed apart
            order = ["ckptstore", "device_get", "orbax"]
            order = order[step % 3 :] + order[: step % 3]
            for who in order:
                # New arrays, as after a training step: none holds a cached host copy.
                state = jax.block_until_ready(step_state(state))
                if saved is not None:  # the last save's arrays (and their host copies) are gone
                    growth.append(rss() - saved)
                    saved = None
                if who == "ckptstore":
                    saved = rss()
                    t = time.perf_counter()
                    handle = mgr.save(step, state)
                    pauses[who].append(time.perf_counter() - t)
                    assert handle is not None
                    handle.wait()
                elif who == "device_get":
                    t = time.perf_counter()
                    copy = jax.device_get(state)
                    pauses[who].append(time.perf_counter() - t)
                    del copy
                else:
                    t = time.perf_counter()
                    orbax_mgr.save(step, args=ocp.args.StandardSave(state))
                    pauses[who].append(time.perf_counter() - t)
                    orbax_mgr.wait_until_finished()
                trace.append((f"{who}@{step}", rss()))
        stats = list(mgr.stats)
    if saved is not None:
        state = jax.block_until_ready(step_state(state))
        growth.append(rss() - saved)
    orbax_mgr.close()
    del state
    later = {who: common.Stats(runs[1:]) for who, runs in pauses.items()}
    ratio = later["ckptstore"].median / later["device_get"].median
    reuse = max(growth[1:]) / size
    return {
        "bytes": size,
        "first_save_pause_s": round(pauses["ckptstore"][0], 6),
        "pause": {who: s.to_json(size) for who, s in later.items()},
        "manager_staging_s": [round(s.staging, 6) for s in stats],
        "pause_vs_device_get": round(ratio, 3),
        "pause_vs_orbax": round(later["ckptstore"].median / later["orbax"].median, 3),
        "rss_growth_bytes": growth,
        "rss_after_bytes": trace,
        "later_growth_of_state": round(reuse, 4),
        "floors": {
            "pause_vs_device_get": [STAGING_FLOOR, ratio <= STAGING_FLOOR],
            "buffer_reuse": [REUSE_FLOOR, reuse < REUSE_FLOOR],
        },
    }


def restore(state: dict[str, Any], root: Path, reps: int) -> dict[str, Any]:
    """`restore_sync` onto the devices vs Orbax's restore onto the same shardings, cold."""
    size = nbytes(state)
    ours, theirs = root / "restore-ckptstore", root / "restore-orbax"
    ckptstore.save_sync(str(ours), state, step=1)
    orbax_save(state, theirs)
    like = abstract(state)
    host = jax.device_get(state)
    shardings = {k: v.sharding for k, v in state.items()}
    files = files_below(ours)
    times: dict[str, list[float]] = {"ckptstore": [], "orbax": [], "read": [], "device_put": []}
    for rep in range(reps):
        order = list(times)
        order = order[rep % 4 :] + order[: rep % 4]
        for who in order:
            evict_tree(theirs if who == "orbax" else ours)
            t = time.perf_counter()
            if who == "ckptstore":
                got = jax.block_until_ready(ckptstore.restore_sync(str(ours), 1, like))
            elif who == "orbax":
                got = orbax_restore(theirs, like)
            elif who == "read":
                got = read_fresh(files)
            else:
                got = jax.block_until_ready(jax.device_put(host, shardings))
            times[who].append(time.perf_counter() - t)
            if rep == 0 and who in ("ckptstore", "orbax"):
                assert equal(got, state), f"{who} restored different data"
            del got
    stats = {who: common.Stats(runs) for who, runs in times.items()}
    speedup = stats["orbax"].median / stats["ckptstore"].median
    floor = stats["read"].median + stats["device_put"].median
    return {
        "bytes": size,
        "restore": {who: s.to_json(size) for who, s in stats.items()},
        "vs_orbax": round(speedup, 3),
        "vs_read_then_put": round(floor / stats["ckptstore"].median, 3),
        "floors": {"vs_orbax": [RESTORE_FLOOR, speedup >= RESTORE_FLOOR]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU devices, 16 MiB, 2 reps")
    parser.add_argument("--mib", type=int, default=4096, help="state size (default 4 GiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help=f"results (default {RESULTS})")
    parser.add_argument("--no-write-results", action="store_true")
    args = parser.parse_args(argv)
    mib, reps = (16, 2) if args.dry else (args.mib, args.reps)
    platform = jax.devices()[0].platform
    if not args.dry and platform == "cpu":
        print("no accelerator here: run with --dry on CPU", file=sys.stderr)
        return 2
    state = make_state(mib)
    with common.scratch_dir("ckptstore-gpu-") as scratch:
        print(f"scratch directory: {scratch}", flush=True)
        result = {
            "when": common.utc_timestamp(),
            "machine": common.machine_info(["jax", "jaxlib", "tensorstore", "orbax-checkpoint"]),
            "devices": [str(d) for d in jax.devices()],
            "platform": platform,
            "dry": args.dry,
            "staging": staging(state, scratch, reps),
            "restore": restore(state, scratch, reps),
        }
    floors = {
        f"{part}.{name}": ok
        for part in ("staging", "restore")
        for name, (_, ok) in result[part]["floors"].items()
    }
    s, r = result["staging"], result["restore"]
    print(f"{len(jax.devices())} {platform} devices, state {s['bytes'] / MiB:.0f} MiB")
    print("| measure | ckptstore | peer | ratio | floor |")
    print("|---|---|---|---|---|")
    print(
        f"| save pause (host staging) | {s['pause']['ckptstore']['median_s']:.4f} s "
        f"| device_get {s['pause']['device_get']['median_s']:.4f} s "
        f"| {s['pause_vs_device_get']}x | <= {STAGING_FLOOR}x |"
    )
    print(
        f"| save pause vs Orbax async | {s['pause']['ckptstore']['median_s']:.4f} s "
        f"| orbax {s['pause']['orbax']['median_s']:.4f} s | {s['pause_vs_orbax']}x | - |"
    )
    print(
        f"| later save's RSS growth | {s['later_growth_of_state']:.2%} of the state | - | - "
        f"| < {REUSE_FLOOR:.0%} |"
    )
    print(
        f"| restore onto devices (cold) | {r['restore']['ckptstore']['median_s']:.4f} s "
        f"| orbax {r['restore']['orbax']['median_s']:.4f} s | {r['vs_orbax']}x "
        f"| >= {RESTORE_FLOOR}x |"
    )
    print(
        f"| restore vs reading its files + device_put (info) "
        f"| {r['restore']['ckptstore']['median_s']:.4f} s "
        f"| read {r['restore']['read']['median_s']:.4f} s + put "
        f"{r['restore']['device_put']['median_s']:.4f} s | {r['vs_read_then_put']}x | - |"
    )
    judged = ", ".join(f"{k} {'PASS' if ok else 'FAIL'}" for k, ok in floors.items())
    # CPU "devices" share host memory (device_get copies nothing): --dry checks the code
    # paths, not the floors.
    print(
        f"floors: not judged on CPU devices (--dry; would be: {judged})"
        if args.dry
        else f"floors: {judged}"
    )
    if not args.no_write_results:
        common.write_results(args.out or RESULTS, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
