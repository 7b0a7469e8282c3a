"""The demo's adapter phase: LoRA fine-tuning over a frozen base, saved every step with
``ManagerOptions(incremental=True)`` (run by demo/run.py after the training runs).

    python demo/adapters.py TARGET [--steps N]

A frozen base (8 float32 layers of 1024x1024, sharded over 8 CPU devices) and rank-8
adapters trained with adamw. Every step is saved and waited for; a save after the first
references the frozen base (the very arrays the previous save was made from) and writes
only the adapters and their optimizer state. Prints, per save, the bytes written against
the state's size; then restores the kept steps and checks they are bit-exact. TARGET is a
directory or a ``.toml`` profile. Exits non-zero if anything did not happen as it should.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore import policies

LAYERS, WIDTH, RANK = 8, 1024, 8


def digest(tree: Any) -> str:
    """sha256 of every leaf's bytes, in tree order: equal digests, bit-exact states."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def forward(base: dict[str, Any], lora: dict[str, Any], x: jax.Array) -> jax.Array:
    for i in range(LAYERS):
        a, b = lora[f"l{i}"]["a"], lora[f"l{i}"]["b"]
        x = jnp.tanh(x @ base[f"l{i}"] + (x @ a) @ b)
    return x


async def stored_bytes(target: str) -> int:
    """Bytes of every object the run left below ``target``."""
    backend = (
        ckptstore.open_backend(profile=target)
        if target.endswith(".toml")
        else ckptstore.open_backend(target)
    )
    async with backend:
        return sum([info.size async for info in backend.list()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    mesh = Mesh(np.array(jax.devices()), ("model",))
    rows = NamedSharding(mesh, P("model", None))
    replicated = NamedSharding(mesh, P())
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    base = {  # frozen: the same arrays at every step
        f"l{i}": jax.device_put(jax.random.normal(keys[i], (WIDTH, WIDTH)) / np.sqrt(WIDTH), rows)
        for i in range(LAYERS)
    }
    lora = {
        f"l{i}": {
            "a": jax.device_put(
                jax.random.normal(keys[LAYERS + i], (WIDTH, RANK)) * 0.01, replicated
            ),
            "b": jax.device_put(jnp.zeros((RANK, WIDTH)), replicated),
        }
        for i in range(LAYERS)
    }
    x = jax.random.normal(keys[-2], (64, WIDTH))
    y = jax.random.normal(keys[-1], (64, WIDTH)) * 0.5
    optimizer = optax.adamw(1e-2)
    opt = jax.tree.map(lambda a: jax.device_put(a, replicated), optimizer.init(lora))

    @jax.jit
    def step_fn(lora: Any, opt: Any) -> tuple[Any, Any]:
        grads = jax.grad(lambda ad: jnp.mean((forward(base, ad, x) - y) ** 2))(lora)
        updates, opt = optimizer.update(grads, opt, lora)
        return optax.apply_updates(lora, updates), opt

    base_bytes = sum(int(v.nbytes) for v in base.values())
    small = sum(int(v.nbytes) for v in jax.tree.leaves((lora, opt)))
    print(
        f"  a frozen base of {base_bytes:,} B ({LAYERS} float32 layers of "
        f"{WIDTH}x{WIDTH}, sharded over {len(jax.devices())} devices) + rank-{RANK} adapters "
        f"and their adamw state, {small:,} B; saved every step with "
        "ManagerOptions(incremental=True), KeepLatest(2)",
        flush=True,
    )
    options = ckptstore.ManagerOptions(incremental=True, handle_sigterm=False)
    digests: dict[int, str] = {}
    problems = []
    with ckptstore.CheckpointManager(
        args.target, keep_policy=policies.KeepLatest(2), options=options
    ) as mgr:
        for step in range(1, args.steps + 1):
            lora, opt = step_fn(lora, opt)
            state = {"base": base, "lora": lora, "opt": opt}
            digests[step] = digest(state)
            handle = mgr.save(step, state)
            assert handle is not None
            stats = handle.wait()
            share, state_bytes = stats.bytes_written / stats.bytes, stats.bytes
            how = (
                "in full: the first save"
                if stats.base is None
                else f"{stats.bytes_referenced:,} B referenced (base: step {stats.base})"
            )
            print(
                f"  step {step}  wrote {stats.bytes_written:>12,} B of {stats.bytes:,} B "
                f"({share:6.1%}), {how}",
                flush=True,
            )
            if step > 1 and stats.bytes_written > small + 4096:
                problems.append(f"step {step} wrote more than the adapters and their state")
        mgr.wait_until_finished()
        kept = mgr.all_steps()
        like = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
        )
        same = [digest(mgr.restore(s, like=like)) == digests[s] for s in kept]
        written = sum(s.bytes_written for s in mgr.stats)
        full = sum(s.bytes for s in mgr.stats)
    shown = ", ".join(map(str, kept))
    verdict = "bit-exact" if all(same) else "DIFFERENT"
    print(f"  restored steps {shown} ({verdict})", flush=True)
    if not all(same):
        problems.append("a restored adapter step differs from the saved one")
    stored = asyncio.run(stored_bytes(args.target))
    print(
        f"  written in all: {written:,} B by {len(digests)} saves (in full: {full:,} B)", flush=True
    )
    print(
        f"  stored for the {len(kept)} kept steps: {stored:,} B, the base once, kept in step "
        f"1's attempt (as full saves: {len(kept) * state_bytes:,} B)",
        flush=True,
    )
    for problem in problems:
        print(f"FAILED: {problem}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
