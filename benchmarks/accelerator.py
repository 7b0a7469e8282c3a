"""What only an accelerator can measure: a save's pause and its time to durable, host memory,
and a cold restore onto the devices, side by side with Orbax and the hardware's own paths.

On the accelerators JAX finds, with a state sharded over all of them (float32 leaves of
64 MiB and one replicated 1 MiB leaf), interleaved, medians of ``--reps``:

1. **saves** (`saves`): per round, in rotating order, each on a state it has not seen (the
   state is stepped on the devices, donated, before each one, as a training loop's is):
   - the manager's pause with ``staging="device"`` (an on-device copy) and its time to
     durable (the call to the commit: `SaveHandle.wait`), with the write and the commit
     (merge, manifest, marker) that it includes (`SaveStats`);
   - Orbax's async `CheckpointManager.save` (its pause) and `wait_until_finished`, with its
     default compression (zstd level 1) and with it off (``orbax_off``: a
     ``PyTreeCheckpointHandler(use_compression=False)`` in the manager's handler registry,
     the raw bytes ckptstore writes);
   - ``jax.device_get`` of the state (the device-to-host path) and ``dd`` with
     ``oflag=direct conv=fsync`` of as many bytes (the disk's own durable write);
   - peak host RSS added during each save, sampled every 2 ms, for both libraries.
   The device-staging manager's first save is timed apart (after one call its policy
   declined, as a loop's first step: then the copy is compiled in the background).
2. **restores** (`restores`): ``ckptstore.restore_sync`` with ``like=`` the state's
   shardings against Orbax's ``StandardCheckpointer().restore`` onto the same shardings of
   its default save and of its save with compression off, files evicted from the page
   cache first, with peak added host RSS.
3. **fallback** (`fallback`): a state larger than half of the device memory: ``staging=
   "auto"`` must fall back to host staging by itself; its pause against ``device_get``.
4. **loop** (`loop`, not in the default parts): what a training loop loses per save with
   ckptstore, Orbax and the hardware's own drain, on four trees (`accelerator_loop`), in
   each of ``--loop-dirs`` (``tmpfs``: /dev/shm, RAM-backed; ``disk``: the scratch directory).
5. **memory** (`memory`, not in the default parts): host memory over ``--long-saves`` saves
   of the LLM-like tree, ckptstore then Orbax, its slope per save (`accelerator_memory`).
6. **interference** (`interference`, not in the default parts): what host work slows the
   training step, and which writers of a host tree slow it (`accelerator_interference`).

    python benchmarks/accelerator.py --out $OUT/tpu.json   # on the accelerator: 4 GiB, 5 reps
    python benchmarks/accelerator.py --dry                 # CPU devices, 16 MiB, 2 reps (make test)
    python benchmarks/accelerator.py --parts loop --trees f256,llm --loop-dirs tmpfs --reps 3

Floors (`FLOORS`) are judged on accelerators only: CPU "devices" share host memory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from benchmarks.save_restore import evict_tree, orbax_manager, orbax_restore, orbax_save

MiB = 1 << 20
RESULTS = Path(__file__).parent / "results"
#: name: (threshold, "<=" or ">=") of each floor judged on accelerators.
FLOORS = {
    "pause_device_vs_orbax": (0.05, "<="),
    "durable_vs_hardware": (1.2, "<="),  # vs max(device_get, dd O_DIRECT+fsync)
    "save_rss_added_gib": (1.0, "<="),  # device staging
    "restore_vs_orbax": (4.0, ">="),  # speed-up
    "restore_rss_added_gib": (1.0, "<="),
    "fallback_pause_vs_device_get": (1.1, "<="),
    "first_pause_vs_later": (1.2, "<="),
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss() -> Iterator[dict[str, int]]:
    """``out["added"]``: the peak RSS above the RSS at entry, sampled every 2 ms."""
    out = {"added": 0}
    base, done = rss(), threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            out["added"] = max(out["added"], rss() - base)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out["added"] = max(out["added"], rss() - base)


def make_state(mib: int, leaf_mib: int = 64) -> dict[str, Any]:
    """``mib`` MiB of float32 leaves of ``leaf_mib`` (fewer when small), sharded over every
    device along their first axis, plus a replicated 1 MiB leaf."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("d",))
    leaf_mib = min(leaf_mib, max(1, mib // 4))
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


STEP = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)


def dd_direct(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    cmd = ["dd", f"if={src}", f"of={dst}", "bs=16M", "oflag=direct", "conv=fsync", "status=none"]
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - start
    dst.unlink()
    return seconds


def manager(root: Path, staging: str) -> ckptstore.CheckpointManager:
    options = ckptstore.ManagerOptions(staging=staging, handle_sigterm=False)  # type: ignore[arg-type]
    never = ckptstore.policies.EveryNSteps(1 << 30)  # saves here are forced
    return ckptstore.CheckpointManager(
        root, save_policy=never, keep_policy=ckptstore.policies.KeepLatest(1), options=options
    )


def saves(state: dict[str, Any], root: Path, reps: int) -> dict[str, Any]:
    """Pauses, times to durable and peak added RSS of each way to save (module docstring)."""
    import orbax.checkpoint as ocp

    size = nbytes(state)
    src = root / "dd_source.bin"
    with open(src, "wb") as f:
        for k in range(0, size, 64 * MiB):
            f.write(np.random.default_rng(k).bytes(min(64 * MiB, size - k)))
    state = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))  # ours to donate
    runs: dict[str, list[float]] = {}
    modes: list[str] = []
    orbax_mgrs = {"orbax": orbax_manager(root / "orbax", True)}
    orbax_mgrs["orbax_off"] = orbax_manager(root / "orbax_off", False)
    mgrs = {s: manager(root / s, s) for s in ("device",)}
    # A loop's first step, which the policy declines (step 0 it would save): the copy
    # compiles meanwhile.
    assert mgrs["device"].save(1, state) is None
    state = jax.block_until_ready(STEP(state))
    first = {}
    for s, mgr in mgrs.items():  # first saves, apart
        t = time.perf_counter()
        handle = mgr.save(2, state, force=True)
        first[s] = time.perf_counter() - t
        assert handle is not None
        handle.wait()
        state = jax.block_until_ready(STEP(state))

    def ours(s: str, step: int) -> Callable[[], None]:
        def run() -> None:
            with peak_rss() as peak:
                t = time.perf_counter()
                handle = mgrs[s].save(step, state, force=True)
                runs.setdefault(f"pause_{s}", []).append(time.perf_counter() - t)
                assert handle is not None
                stats = handle.wait()
            runs.setdefault(f"durable_{s}", []).append(time.perf_counter() - t)
            runs.setdefault(f"write_{s}", []).append(stats.write)
            runs.setdefault(f"commit_{s}", []).append(stats.merge + stats.commit)
            runs.setdefault(f"rss_{s}", []).append(peak["added"])
            modes.append(stats.staging_mode)

        return run

    def orbax(who: str, step: int) -> Callable[[], None]:
        def run() -> None:
            mgr = orbax_mgrs[who]
            args = ocp.args.StandardSave(state) if who == "orbax" else ocp.args.PyTreeSave(state)
            with peak_rss() as peak:
                t = time.perf_counter()
                mgr.save(step, args=args)
                runs.setdefault(f"pause_{who}", []).append(time.perf_counter() - t)
                mgr.wait_until_finished()
            runs.setdefault(f"durable_{who}", []).append(time.perf_counter() - t)
            runs.setdefault(f"rss_{who}", []).append(peak["added"])

        return run

    def device_get() -> None:
        t = time.perf_counter()
        copy = jax.device_get(state)
        runs.setdefault("device_get", []).append(time.perf_counter() - t)
        del copy

    for step in range(3, reps + 3):
        order: list[Callable[[], None]] = [
            ours("device", step),
            orbax("orbax", step),
            orbax("orbax_off", step),
            device_get,
            lambda: runs.setdefault("dd_direct", []).append(dd_direct(src, root / "dd.out")),
        ]
        turn = step % len(order)
        order = order[turn:] + order[:turn]
        for op in order:
            state = jax.block_until_ready(STEP(state))  # new arrays: none has a host copy
            op()
        progress(f"saves, round {step - 2}", runs)
    for mgr in mgrs.values():
        mgr.close()
    for orbax_mgr in orbax_mgrs.values():
        orbax_mgr.close()
    src.unlink()
    return {"bytes": size, "first_pause_s": first, "modes": sorted(set(modes)), "runs": runs}


def restores(state: dict[str, Any], root: Path, reps: int) -> dict[str, Any]:
    """`restore_sync` onto the devices vs Orbax's restore onto the same shardings, cold."""
    where = {who: root / f"restore-{who}" for who in ("ckptstore", "orbax", "orbax_off")}
    ckptstore.save_sync(str(where["ckptstore"]), state, step=1)
    orbax_save(state, where["orbax"])
    orbax_save(state, where["orbax_off"], compress=False)
    like = abstract(state)
    runs: dict[str, list[float]] = {}
    for rep in range(reps):
        order = list(where)[rep % 3 :] + list(where)[: rep % 3]
        for who in order:
            evict_tree(where[who])
            with peak_rss() as peak:
                t = time.perf_counter()
                if who == "ckptstore":
                    got = ckptstore.restore_sync(str(where[who]), 1, like)
                    got = jax.block_until_ready(got)
                else:
                    got = orbax_restore(where[who], like)
                runs.setdefault(f"restore_{who}", []).append(time.perf_counter() - t)
            runs.setdefault(f"rss_{who}", []).append(peak["added"])
            if rep == 0:
                assert equal(got, state), f"{who} restored different data"
            del got
        progress(f"restores, round {rep + 1}", runs)
    return {"bytes": nbytes(state), "runs": runs}


def fallback(root: Path, reps: int, mib: int) -> dict[str, Any]:
    """A state too large for a device copy: "auto" falls back to host staging."""
    state = make_state(mib)
    print(f"fallback state: {nbytes(state) >> 20} MiB", flush=True)
    runs: dict[str, list[float]] = {}
    modes = []
    with manager(root / "fallback", "auto") as mgr:
        # A loop's first step, declined: the host buffers are made meanwhile (`warm`).
        assert mgr.save(1, state) is None
        for step in range(2, reps + 2):
            for who in ("auto", "device_get") if step % 2 else ("device_get", "auto"):
                state = jax.block_until_ready(STEP(state))
                t = time.perf_counter()
                if who == "auto":
                    handle = mgr.save(step, state, force=True)
                    runs.setdefault("pause_auto", []).append(time.perf_counter() - t)
                    assert handle is not None
                    stats = handle.wait()
                    modes.append((stats.staging_mode, stats.staging_reason))
                else:
                    copy = jax.device_get(state)
                    runs.setdefault("device_get", []).append(time.perf_counter() - t)
                    del copy
            progress(f"fallback, round {step - 1}", runs)
    return {"bytes": nbytes(state), "modes": sorted(set(modes)), "runs": runs}


def loops(args: argparse.Namespace, scratch: Path, mib: int, reps: int) -> dict[str, Any]:
    """The loop part in each of ``--loop-dirs``."""
    from benchmarks.accelerator_loop import loop_part

    # --dry checks the code paths: one round of each contender (16 runs per directory)
    every, saves, reps = (4, 2, 1) if args.dry else (args.every, args.saves, reps)
    out = {}
    for where in args.loop_dirs.split(","):
        # --dry: the scratch directory for both (a container's /dev/shm may be 64 MiB)
        base = Path("/dev/shm") if where == "tmpfs" and not args.dry else scratch
        with common.scratch_dir("ckptstore-loop-", base) as root:
            trees = args.trees.split(",")
            variants = args.variants.split(",") if args.profile else None
            out[where] = loop_part(root, args.dry, mib, trees, every, saves, reps, variants)
    return out


def progress(what: str, runs: dict[str, list[float]]) -> None:
    latest = ", ".join(f"{k} {v[-1]:.4g}" for k, v in runs.items())
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {latest}", flush=True)


def median(runs: list[float]) -> float:
    return common.Stats(runs).median


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The ratios the floors judge, from the runs (of the parts that ran)."""
    out: dict[str, float] = {}
    if "saves" in result:
        s = result["saves"]["runs"]
        hardware = max(median(s["device_get"]), median(s["dd_direct"]))
        out["pause_device_vs_orbax"] = median(s["pause_device"]) / median(s["pause_orbax"])
        out["durable_vs_hardware"] = median(s["durable_device"]) / hardware
        out["durable_orbax_vs_hardware"] = median(s["durable_orbax"]) / hardware
        if "pause_orbax_off" in s:  # runs before the contender with compression off lack it
            out["pause_device_vs_orbax_off"] = median(s["pause_device"]) / median(
                s["pause_orbax_off"]
            )
            out["durable_orbax_off_vs_hardware"] = median(s["durable_orbax_off"]) / hardware
        # The disk's speed varies several-fold within a run (a cloud disk's burst credit):
        # the same ratio per round, against that round's own device_get and dd, is steadier.
        rounds = zip(s["durable_device"], s["device_get"], s["dd_direct"], strict=True)
        out["durable_vs_hardware_per_round"] = median([d / max(g, w) for d, g, w in rounds])
        out["save_rss_added_gib"] = max(s["rss_device"]) / (1 << 30)
        out["orbax_save_rss_added_gib"] = max(s["rss_orbax"]) / (1 << 30)
        first = result["saves"]["first_pause_s"]["device"]
        out["first_pause_vs_later"] = first / median(s["pause_device"])
    if "restores" in result:
        r = result["restores"]["runs"]
        out["restore_vs_orbax"] = median(r["restore_orbax"]) / median(r["restore_ckptstore"])
        if "restore_orbax_off" in r:
            ours = median(r["restore_ckptstore"])
            out["restore_vs_orbax_off"] = median(r["restore_orbax_off"]) / ours
        out["restore_rss_added_gib"] = max(r["rss_ckptstore"]) / (1 << 30)
        out["orbax_restore_rss_added_gib"] = max(r["rss_orbax"]) / (1 << 30)
    if "fallback" in result:
        f = result["fallback"]["runs"]
        out["fallback_pause_vs_device_get"] = median(f["pause_auto"]) / median(f["device_get"])
    return {k: round(v, 4) for k, v in out.items()}


def summary(result: dict[str, Any]) -> str:
    """A markdown table of every measure: median (min-max)."""
    rows = []
    for part in ("saves", "restores", "fallback"):
        for name, values in result.get(part, {}).get("runs", {}).items():
            unit, scale = ("GiB", 1 / (1 << 30)) if name.startswith("rss") else ("s", 1.0)
            st = common.Stats([v * scale for v in values])
            rows.append([part, name, f"{st.median:.4f} {unit} ({st.min:.4f}-{st.max:.4f})"])
    table = common.markdown_table(["part", "measure", "median (min-max)"], rows)
    judged = []
    for name, value in result["figures"].items():
        floor = FLOORS.get(name)
        verdict = "-"
        if floor is not None:
            ok = value <= floor[0] if floor[1] == "<=" else value >= floor[0]
            verdict = f"{floor[1]} {floor[0]}: {'PASS' if ok else 'FAIL'}"
        judged.append([name, f"{value}", verdict])
    table += "\n\n" + common.markdown_table(["figure", "value", "floor"], judged)
    if "loop" in result:
        from benchmarks.accelerator_loop import loop_table

        table += "\n\n" + loop_table(result["loop"], judge=not result["dry"])
    if "memory" in result:
        from benchmarks.accelerator_memory import memory_table

        table += "\n\n" + memory_table(result["memory"], judge=not result["dry"])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU devices, 16 MiB, 2 reps")
    parser.add_argument("--mib", type=int, default=4096, help="state size (default 4 GiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--fallback-share",
        type=float,
        default=0.6,
        help="the fallback state's size, a share of the device memory",
    )
    parser.add_argument(
        "--parts",
        default="saves,restores,fallback",
        help="which parts to run (comma-separated; default all)",
    )
    parser.add_argument("--trees", default="f64,f256,f1g,llm", help="the loop part's trees")
    parser.add_argument("--every", type=int, default=100, help="loop: steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="loop: saves per run")
    parser.add_argument("--loop-dirs", default="tmpfs,disk", help="loop: tmpfs and/or disk")
    parser.add_argument("--long-saves", type=int, default=200, help="memory: saves per library")
    parser.add_argument("--profile", action="store_true", help="loop: sample the lock too")
    parser.add_argument(
        "--variants", default="", help="loop --profile: ckptstore variants (comma-separated)"
    )
    parser.add_argument("--out", type=Path, default=None, help="results (default: by platform)")
    parser.add_argument("--no-write-results", action="store_true")
    args = parser.parse_args(argv)
    mib, reps = (16, 2) if args.dry else (args.mib, args.reps)
    device = jax.devices()[0]
    if not args.dry and device.platform == "cpu":
        print("no accelerator here: run with --dry on CPU", file=sys.stderr)
        return 2
    limit = (device.memory_stats() or {}).get("bytes_limit")
    with common.scratch_dir("ckptstore-accelerator-") as scratch:
        print(f"scratch directory: {scratch}", flush=True)
        result: dict[str, Any] = {
            "when": common.utc_timestamp(),
            "machine": common.machine_info(["jax", "jaxlib", "tensorstore", "orbax-checkpoint"]),
            "devices": [str(d) for d in jax.devices()],
            "platform": device.platform,
            "device_kind": device.device_kind,
            "dry": args.dry,
        }
        out = args.out or RESULTS / (
            "accelerator_" + device.device_kind.lower().replace(" ", "_") + ".json"
        )
        parts = set(args.parts.split(","))
        if parts & {"saves", "restores"}:
            state = make_state(mib)
            if "saves" in parts:
                result["saves"] = saves(state, scratch, reps)
            if "restores" in parts:
                result["restores"] = restores(state, scratch, reps)
            del state
        if "loop" in parts:
            result["loop"] = loops(args, scratch, mib, reps)
        if "interference" in parts:
            from benchmarks.accelerator_interference import interference_part

            result["interference"] = interference_part(scratch, args.dry, mib, reps)
        if "memory" in parts:
            from benchmarks.accelerator_memory import memory_part

            long_saves = 12 if args.dry else args.long_saves
            result["memory"] = memory_part(scratch, args.dry, mib, long_saves)
        # a state larger than half of the device memory
        if limit and not args.dry and "fallback" in parts:
            if not args.no_write_results:
                common.write_results(out, result)  # what was measured, should this run out
            big = int(limit * args.fallback_share) // MiB
            result["fallback"] = fallback(scratch, reps, big)
    result["figures"] = figures(result)
    print(f"{len(jax.devices())} {device.device_kind} devices, state {mib} MiB")
    print(summary(result))
    if args.dry:
        print("floors: not judged on CPU devices (--dry checks the code paths)")
    if not args.no_write_results:
        common.write_results(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
