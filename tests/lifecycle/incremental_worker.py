"""A LoRA-like run (a frozen sharded base, adapters that change every step) through a
`CheckpointManager` with ``incremental=True``, for `test_manager_incremental.py`.

``python -m tests.lifecycle.incremental_worker ROOT STEPS [--die-at K]``: resumes from the
latest committed step under ROOT (or starts at step 0), saves every step, keeps the 2
latest, and prints one JSON line per committed save (``{"step", "bytes", "written",
"referenced", "base"}``) and, at the end, a digest of the state.
``--die-at K``: SIGKILL itself right after ``save(K)`` returned (the save is in flight).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore

FROZEN_SHAPE = (1024, 1024)  # 4 MiB of float32, sharded over every device


def sharding(*spec: str | None) -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P(*spec))


def initial() -> dict[str, Any]:
    """Step 0's state: the frozen base (sharded) and zero adapters (replicated)."""
    frozen = np.random.default_rng(0).standard_normal(FROZEN_SHAPE).astype(np.float32)

    def zeros(*shape: int) -> jax.Array:
        return jax.device_put(np.zeros(shape, np.float32), sharding())

    return {
        "base": {"w": jax.device_put(frozen, sharding("x"))},
        "lora": {"a": zeros(1024, 8), "b": zeros(8, 1024)},
        "opt": {"mu": zeros(1024, 8)},
    }


@jax.jit
def advance(state: dict[str, Any], step: jax.Array) -> dict[str, Any]:
    """One training step: the adapters and their optimizer state change, the base does not."""
    s = step.astype(jnp.float32)
    a = state["lora"]["a"] * 0.5 + jnp.sin(s)
    return {
        "base": state["base"],
        "lora": {"a": a, "b": state["lora"]["b"] * 0.25 - s},
        "opt": {"mu": state["opt"]["mu"] * 0.9 + a},
    }


def state_at(step: int) -> dict[str, Any]:
    """The state after ``step`` training steps, from scratch (what a test expects)."""
    state = initial()
    for k in range(1, step + 1):
        state = advance(state, jnp.int32(k))
    return state


def like() -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), initial()
    )


def digest(state: Any) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("steps", type=int)
    parser.add_argument("--die-at", type=int)
    args = parser.parse_args()
    options = ckptstore.ManagerOptions(handle_sigterm=False, incremental=True)
    keep = ckptstore.policies.KeepLatest(2)
    with ckptstore.CheckpointManager(args.root, keep_policy=keep, options=options) as mgr:
        state, start = initial(), 0
        if (latest := mgr.latest_step()) is not None:
            state, start = mgr.restore(latest, like=like()), latest
        for step in range(start + 1, args.steps + 1):
            state = advance(state, jnp.int32(step))
            handle = mgr.save(step, state)
            assert handle is not None
            if step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            stats = handle.wait()
            line = {
                "step": step,
                "bytes": stats.bytes,
                "written": stats.bytes_written,
                "referenced": stats.bytes_referenced,
                "base": stats.base,
            }
            print(json.dumps(line), flush=True)
        mgr.wait_until_finished()
    print(json.dumps({"digest": digest(state)}), flush=True)


if __name__ == "__main__":
    main()
