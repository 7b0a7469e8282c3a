"""What a training loop loses per save on an accelerator (`accelerator.py --parts loop`).

A donated, jitted training step (~50 ms on a TPU v5e: matmuls on a side weight, then every
leaf of the state updated), a save every ``every`` steps, each library's manager called at
every step as a loop calls it. Contenders, interleaved (the first one rotates per round):

- ``none``: no checkpointing, the baseline every loss is measured against;
- ``ckptstore``: `CheckpointManager` with ``staging="auto"`` (on an accelerator with room:
  an on-device copy, drained in the background), `EveryNSteps`, `KeepLatest(1)`;
- ``orbax``: Orbax's async `CheckpointManager` (``save_interval_steps``, ``max_to_keep=1``,
  ``StandardSave``, its default compression), saving the same steps;
- ``drain``: the hardware's own drain, the simplest correct thing: an on-device copy, then
  one thread that moves one leaf at a time to the host (``np.asarray``) and writes it to a
  file, fsync at the end (the next save waits for the last one).

Each step is waited for (a loop reading its loss), then the manager is called. Per run: the
loop's wall time (the save calls included), each step's time (with its save call), the pause
of each save (its call), the time from the end
of the loop until the last save is durable, and the peak host RSS added (sampled every
2 ms). Figures per contender: loop time lost per save (its loop time less the same round's
``none`` loop time, over the saves), slowed steps (> 1.3x the baseline's median step),
pause, time to durable after the last step, added RSS.

``--profile`` (`benchmarks.loop_profile`): before the rounds, one more run each with the
steps split into dispatch and wait beside the save's transfers and writes, and the
interpreter lock sampled; ``--variants`` adds ckptstore runs with its write path changed.

Trees (``--trees``), each ``mib`` MiB or about: ``f64``/``f256``/``f1g``: float32 leaves of
64 MiB / 256 MiB / 1 GiB (fewer, smaller ones when ``mib`` is small); ``llm``: a model's
shapes: a bf16 embedding of a 50k vocabulary, stacked (per layer) bf16 attention and MLP
weights, float32 norms, float32 Adam moments (``mu``, ``nu``) of every parameter, an int32
step and a PRNG key.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks import common
from benchmarks.timeline import SLOW, TIMELINE

MiB = 1 << 20
CONTENDERS = ("none", "ckptstore", "orbax", "drain")


# -- trees -------------------------------------------------------------------------------


def _sharded(host: np.ndarray[Any, Any], mesh: Mesh) -> jax.Array:
    """``host`` on the mesh, split along its first axis where it divides, else replicated."""
    n = mesh.devices.size
    spec = P("d") if host.ndim and host.shape[0] % n == 0 else P()
    return jax.device_put(host, NamedSharding(mesh, spec))


def _normal(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def uniform_tree(mib: int, leaf_mib: int, mesh: Mesh) -> dict[str, Any]:
    """``mib`` MiB of float32 leaves of ``leaf_mib`` each (at least 4 leaves)."""
    leaf_mib = max(1, min(leaf_mib, mib // 4))
    rows = mesh.devices.size * 64
    cols = leaf_mib * MiB // 4 // rows
    return {
        f"w{i:03d}": _sharded(_normal((rows, cols), np.float32, i), mesh)
        for i in range(max(1, mib // leaf_mib))
    }


def llm_tree(mib: int, mesh: Mesh) -> dict[str, Any]:
    """A model's shapes (module docstring); ~3.5 GiB at ``mib=4096`` (d 3072, 2 layers),
    scaled down with ``mib``."""
    scale = math.sqrt(mib / 4096)
    n = mesh.devices.size
    d = max(n * 8, int(3072 * scale) // (n * 8) * (n * 8))
    vocab = max(n * 8, int(50304 * scale) // (n * 8) * (n * 8))
    layers = 2
    bf16 = jnp.bfloat16
    shapes: dict[str, tuple[tuple[int, ...], Any]] = {
        "embed": ((vocab, d), bf16),
        "final_norm": ((d,), np.float32),
    }
    for name in ("wq", "wk", "wv", "wo"):
        shapes[f"layers/attn/{name}"] = ((layers, d, d), bf16)
    shapes["layers/mlp/up"] = ((layers, d, 4 * d), bf16)
    shapes["layers/mlp/down"] = ((layers, 4 * d, d), bf16)
    shapes["layers/norm1"] = ((layers, d), np.float32)
    shapes["layers/norm2"] = ((layers, d), np.float32)
    params: dict[str, Any] = {}
    mu: dict[str, Any] = {}
    nu: dict[str, Any] = {}
    for seed, (name, (shape, dtype)) in enumerate(sorted(shapes.items())):
        # Layers stacked on their first axis shard along their second (d), as a model does.
        params[name] = _leaf(_normal(shape, dtype, seed), mesh)
        mu[name] = _leaf(_normal(shape, np.float32, 1000 + seed) * 0.01, mesh)
        nu[name] = _leaf(np.abs(_normal(shape, np.float32, 2000 + seed)) * 1e-4, mesh)
    return {
        "params": params,
        "opt": {"mu": mu, "nu": nu, "count": jnp.asarray(0, jnp.int32)},
        "step": jnp.asarray(0, jnp.int32),
        "rng": jax.random.key(0),
    }


def _leaf(host: np.ndarray[Any, Any], mesh: Mesh) -> jax.Array:
    n = mesh.devices.size
    axis = 1 if host.ndim == 3 else 0
    if host.ndim and host.shape[axis] % n == 0:
        spec = P(*([None] * axis + ["d"]))
        return jax.device_put(host, NamedSharding(mesh, spec))
    return jax.device_put(host, NamedSharding(mesh, P()))


TREES: dict[str, Callable[[int, Mesh], dict[str, Any]]] = {
    "f64": lambda mib, mesh: uniform_tree(mib, 64, mesh),
    "f256": lambda mib, mesh: uniform_tree(mib, 256, mesh),
    "f1g": lambda mib, mesh: uniform_tree(mib, 1024, mesh),
    "llm": llm_tree,
}


def make_tree(name: str, mib: int) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    return jax.block_until_ready(TREES[name](mib, mesh))


def tree_bytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


# -- the step ----------------------------------------------------------------------------


def make_step(dry: bool) -> tuple[Callable[[Any, Any], Any], Any]:
    """A donated step and its side weight: ~50 ms of matmuls on a TPU v5e (a few ms on
    CPU devices with ``dry``), then every leaf of the state updated."""
    size, rounds = (256, 1) if dry else (8192, 6)
    weight = jnp.ones((size, size), jnp.bfloat16)

    def update(x: Any, s: Any) -> Any:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.fold_in(x, 1)
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x + 1
        return (x * 0.999 + s).astype(x.dtype)

    def step(state: Any, w: Any) -> Any:
        y = w
        for _ in range(rounds):
            y = (y @ w) * 1e-4
        s = jnp.sum(y.astype(jnp.float32)) * 1e-9
        return jax.tree.map(lambda x: update(x, s), state)

    return jax.jit(step, donate_argnums=0), weight


# -- contenders --------------------------------------------------------------------------


#: The drain's on-device copy: one jitted function, compiled once per tree (in the warm-up).
_COPY = jax.jit(lambda t: jax.tree.map(jnp.copy, t))


class Drain:
    """The hardware's own drain (module docstring): `save` is the pause."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.thread: threading.Thread | None = None
        self.error: list[BaseException] = []

    def save(self, step: int, state: Any) -> None:
        self.wait()
        leaves = jax.tree.leaves(_COPY(state))
        jax.block_until_ready(leaves)
        path = self.root / f"{step}.bin"

        def run() -> None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for i in range(len(leaves)):
                        leaf = leaves[i]
                        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                            leaf = jax.random.key_data(leaf)
                        with TIMELINE.span("transfer"):
                            host = np.ascontiguousarray(np.asarray(leaf)).reshape(-1)
                        view = memoryview(host.view(np.uint8))
                        leaves[i] = None
                        with TIMELINE.span("write"):
                            while view:
                                view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                for old in self.root.glob("*.bin"):
                    if old != path:
                        old.unlink()
            except BaseException as exc:  # reported by wait()
                self.error.append(exc)

        self.thread = threading.Thread(target=run, name="drain", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error:
            raise self.error[0]

    def close(self) -> None:
        self.wait()


def ours(root: Path, every: int) -> Any:
    options = ckptstore.ManagerOptions(staging="auto", handle_sigterm=False)
    return ckptstore.CheckpointManager(
        str(root),
        save_policy=ckptstore.policies.EveryNSteps(every),
        keep_policy=ckptstore.policies.KeepLatest(1),
        options=options,
    )


def orbax(root: Path, every: int) -> Any:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=1, save_interval_steps=every, enable_async_checkpointing=True
    )
    return ocp.CheckpointManager(root, options=options)


def one_run(
    who: str, tree: Any, root: Path, step_fn: Any, weight: Any, every: int, saves: int
) -> tuple[Any, dict[str, Any]]:
    """One loop of ``saves * every`` steps (from step 1) with contender ``who``; returns the
    state it ended with and what was measured."""
    import orbax.checkpoint as ocp

    from benchmarks.accelerator import peak_rss

    steps = saves * every
    mgr: Any = None
    where = root / f"{who}-{time.monotonic_ns()}"  # removed after the run (tmpfs is memory)
    if who == "ckptstore":
        mgr = ours(where, every)
    elif who == "orbax":
        mgr = orbax(where, every)
    elif who == "drain":
        mgr = Drain(where)
    step_times: list[float] = []
    save_calls: list[float] = []
    with peak_rss() as peak:
        start = time.perf_counter()
        for step in range(1, steps + 1):
            t = time.perf_counter()
            tree = step_fn(tree, weight)
            dispatched = time.perf_counter()
            jax.block_until_ready(tree)  # a loop reading its loss every step
            called = time.perf_counter()
            TIMELINE.add("dispatch", t, dispatched)
            TIMELINE.add("step", t, called)
            if who == "ckptstore":
                mgr.save(step, tree)
            elif who == "orbax":
                mgr.save(step, args=ocp.args.StandardSave(tree))
            elif who == "drain" and step % every == 0:
                mgr.save(step, tree)
            done = time.perf_counter()
            step_times.append(done - t)
            if step % every == 0:
                save_calls.append(done - called)
                TIMELINE.add("save_call", called, done)
        loop = time.perf_counter() - start
        t = time.perf_counter()
        if who == "ckptstore":
            mgr.wait_until_finished()
        elif who == "orbax":
            mgr.wait_until_finished()
        elif who == "drain":
            mgr.wait()
        durable = time.perf_counter() - t
    if mgr is not None:
        mgr.close()
    shutil.rmtree(where, ignore_errors=True)
    return tree, {
        "loop_s": loop,
        "durable_after_s": durable,
        "step_s": step_times,
        "save_call_s": save_calls,
        "rss_added": peak["added"],
    }


def rounds(
    tree: Any, root: Path, dry: bool, every: int, saves: int, reps: int
) -> dict[str, list[dict[str, Any]]]:
    """``reps`` rounds of every contender, the first one rotating; a short warm-up run of
    each first (compiles, first saves) that is not counted."""
    step_fn, weight = make_step(dry)
    out: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for who in CONTENDERS:  # warm-up: compiles, imports, first-save costs
        tree, _ = one_run(who, tree, root, step_fn, weight, 2, 1)
    for rep in range(reps):
        order = CONTENDERS[rep % len(CONTENDERS) :] + CONTENDERS[: rep % len(CONTENDERS)]
        for who in order:
            tree, got = one_run(who, tree, root, step_fn, weight, every, saves)
            out[who].append(got)
            print(
                f"[{time.strftime('%H:%M:%S')}] round {rep + 1} {who}: loop {got['loop_s']:.2f} s,"
                f" durable after {got['durable_after_s']:.2f} s,"
                f" RSS +{got['rss_added'] / (1 << 30):.2f} GiB",
                flush=True,
            )
    return out


def figures(runs: dict[str, list[dict[str, Any]]], saves: int) -> dict[str, Any]:
    """Per contender, medians over rounds (with min and max) of the module docstring's
    figures, and the ratios the floors judge."""
    base_step = float(np.median([s for r in runs["none"] for s in r["step_s"]]))
    out: dict[str, Any] = {"base_step_s": base_step}
    for who in CONTENDERS:
        per: dict[str, list[float]] = collections.defaultdict(list)
        for rep, got in enumerate(runs[who]):
            per["lost_per_save_s"].append((got["loop_s"] - runs["none"][rep]["loop_s"]) / saves)
            per["slowed_steps"].append(sum(s > SLOW * base_step for s in got["step_s"]))
            per["pause_s"].append(float(np.median(got["save_call_s"])))
            per["durable_after_s"].append(got["durable_after_s"])
            per["rss_added_gib"].append(got["rss_added"] / (1 << 30))
        out[who] = {k: _summary(v) for k, v in per.items()}
    if runs["ckptstore"] and runs["drain"] and runs["orbax"]:

        def med(who: str, what: str) -> float:
            return float(out[who][what]["median"])

        lost = med("ckptstore", "lost_per_save_s")
        out["lost_vs_drain"] = round(lost / max(med("drain", "lost_per_save_s"), 1e-3), 3)
        out["lost_vs_orbax"] = round(lost / max(med("orbax", "lost_per_save_s"), 1e-3), 3)
        out["pause_vs_orbax"] = round(med("ckptstore", "pause_s") / med("orbax", "pause_s"), 4)
        out["durable_vs_drain"] = round(
            med("ckptstore", "durable_after_s") / max(med("drain", "durable_after_s"), 1e-3), 3
        )
    return out


def _summary(values: list[float]) -> dict[str, Any]:
    st = common.Stats(values)
    runs = [round(v, 4) for v in values]
    return {"runs": runs, "median": st.median, "min": st.min, "max": st.max}


def loop_part(
    root: Path,
    dry: bool,
    mib: int,
    trees: list[str],
    every: int,
    saves: int,
    reps: int,
    variants: list[str] | None = None,
) -> dict[str, Any]:
    """The loop part of `accelerator.py`, on each of ``trees``; with ``variants`` (a list,
    "" for ckptstore as it is), the profile first (`benchmarks.loop_profile`)."""
    out: dict[str, Any] = {"every": every, "saves": saves, "reps": reps, "trees": {}}
    for name in trees:
        tree = make_tree(name, mib)
        leaves = len(jax.tree.leaves(tree))
        print(f"tree {name}: {tree_bytes(tree) >> 20} MiB, {leaves} leaves", flush=True)
        got: dict[str, Any] = {"bytes": tree_bytes(tree), "leaves": leaves}
        if variants is not None:
            from benchmarks.loop_profile import profile

            tree, got["profile"] = profile(tree, root, dry, every, saves, variants)
        if reps:
            runs = rounds(tree, root, dry, every, saves, reps)
            got["figures"] = figures(runs, saves)
            got["runs"] = {
                who: [{k: v for k, v in r.items() if k != "step_s"} for r in rs]
                for who, rs in runs.items()
            }
            got["steps_ms"] = {
                who: [[round(1000 * s, 1) for s in r["step_s"]] for r in rs]
                for who, rs in runs.items()
            }
        out["trees"][name] = got
        del tree
    return out


#: Floors of the loop part, on the RAM-backed directory: (threshold, "<=").
LOOP_FLOORS = {"lost_vs_drain": 1.5, "lost_vs_orbax": 0.2, "durable_vs_drain": 1.2}


def loop_table(loop: dict[str, Any], judge: bool) -> str:
    """Markdown: per directory, tree and contender, medians (min-max) of the figures; then
    the ratios with their floors (judged where ``judge``: on accelerators, on tmpfs)."""
    rows, judged = [], []
    for where, part in loop.items():
        for tree, got in part["trees"].items():
            if "figures" not in got:  # --reps 0: the profile only
                continue
            fig = got["figures"]
            for who in CONTENDERS:
                cells = [where, tree, who]
                for what in ("lost_per_save_s", "slowed_steps", "pause_s", "durable_after_s"):
                    st = fig[who][what]
                    cells.append(f"{st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f})")
                cells.append(f"{fig[who]['rss_added_gib']['max']:.2f}")
                rows.append(cells)
            for name, floor in LOOP_FLOORS.items():
                if name in fig:
                    verdict = ("PASS" if fig[name] <= floor else "FAIL") if judge else "-"
                    verdict = verdict if where == "tmpfs" else "(disk: reported)"
                    judged.append([where, tree, name, str(fig[name]), f"<= {floor}: {verdict}"])
    head = ["dir", "tree", "who", "lost/save s", "slowed steps", "pause s", "durable after s"]
    table = common.markdown_table([*head, "RSS+ GiB (max)"], rows)
    ratios = common.markdown_table(["dir", "tree", "ratio", "value", "floor"], judged)
    return table + "\n\n" + ratios
