"""A Flax NNX model with Dropout trained through a `CheckpointManager`, as a user writes it
(no code for its PRNG keys), for `test_nnx_resume.py`.

``python -m tests.lifecycle.nnx_worker ROOT STEPS [--die-at K]``: resumes from the latest
committed step under ROOT (or starts at step 0), saves every 2 steps, and prints one JSON
line per step (``{"step": s, "loss": l}``) and, at the end, a digest of the whole state.
``--die-at K``: SIGKILL itself right after training step K (a save may be in flight).
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
import optax
from flax import nnx

import ckptstore


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin1 = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.lin2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lin2(self.drop(jax.nn.relu(self.lin1(x))))


def make() -> tuple[Model, nnx.Optimizer[Model]]:
    model = Model(nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model: Model, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: Model) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def digest(state: Any) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("steps", type=int)
    parser.add_argument("--die-at", type=int)
    args = parser.parse_args()
    x = jax.random.normal(jax.random.key(0), (64, 8))
    y = jnp.sum(x, axis=1, keepdims=True)
    options = ckptstore.ManagerOptions(handle_sigterm=False)
    policy = ckptstore.policies.EveryNSteps(2)
    with ckptstore.CheckpointManager(args.root, save_policy=policy, options=options) as mgr:
        model, optimizer = make()
        start = 0
        if (latest := mgr.latest_step()) is not None:
            nnx.update((model, optimizer), mgr.restore(latest, like=nnx.state((model, optimizer))))
            start = latest
        for step in range(start + 1, args.steps + 1):
            loss = float(train_step(model, optimizer, x, y))
            print(json.dumps({"step": step, "loss": loss}), flush=True)
            mgr.save(step, nnx.state((model, optimizer)))
            if step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait_until_finished()
    print(json.dumps({"digest": digest(nnx.state((model, optimizer)))}), flush=True)


if __name__ == "__main__":
    main()
