"""The demo's training job: an MLP on scikit-learn's bundled digits, checkpointed by a
`ckptstore.CheckpointManager` (run by demo/run.py, which preempts and restarts it).

Every line it prints to stdout is one JSON event, for the orchestrator to show and sum up.
Batches depend only on the step number, so a resumed run trains exactly as an
uninterrupted one would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import ckptstore
from ckptstore import policies

HIDDEN = 1024
BATCH = 256


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def digest(tree: Any) -> str:
    """sha256 of every leaf's bytes, in tree order: equal digests, bit-exact states."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def init_params(key: jax.Array) -> dict[str, Any]:
    k1, k2, k3 = jax.random.split(key, 3)
    scale = lambda n: 1.0 / np.sqrt(n)  # noqa: E731
    return {
        "l1": {"w": jax.random.normal(k1, (64, HIDDEN)) * scale(64), "b": jnp.zeros(HIDDEN)},
        "l2": {
            "w": jax.random.normal(k2, (HIDDEN, HIDDEN)) * scale(HIDDEN),
            "b": jnp.zeros(HIDDEN),
        },
        "l3": {"w": jax.random.normal(k3, (HIDDEN, 10)) * scale(HIDDEN), "b": jnp.zeros(10)},
    }


def logits(params: dict[str, Any], x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["l1"]["w"] + params["l1"]["b"])
    h = jax.nn.relu(h @ params["l2"]["w"] + params["l2"]["b"])
    return h @ params["l3"]["w"] + params["l3"]["b"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-every", type=int, default=25)
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, y_train, x_val, y_val = x[:1500], y[:1500], x[1500:], y[1500:]

    mesh = Mesh(np.array(jax.devices()), ("model",))
    shardings = {  # the big layer split over the 8 devices, the rest replicated
        "l1": {"w": P(None, "model"), "b": P("model")},
        "l2": {"w": P("model", None), "b": P()},
        "l3": {"w": P(), "b": P()},
    }
    to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    param_shardings = jax.tree.map(to_sharding, shardings, is_leaf=lambda s: isinstance(s, P))
    optimizer = optax.adam(1e-3)

    def fresh_state() -> dict[str, Any]:
        params = jax.device_put(init_params(jax.random.key(0)), param_shardings)
        # Scalars of the optimizer state (its step count) replicated, like everything else
        # committed to the mesh: a restored state then has exactly these shardings.
        replicated = NamedSharding(mesh, P())
        opt = jax.tree.map(
            lambda a: a if a.ndim else jax.device_put(a, replicated), optimizer.init(params)
        )
        return {"params": params, "opt": opt}

    def loss_fn(params: dict[str, Any], xb: jax.Array, yb: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits(params, xb), yb).mean()

    @jax.jit
    def train_step(state: dict[str, Any], xb: jax.Array, yb: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], xb, yb)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    step_donating = jax.jit(train_step.__wrapped__, donate_argnums=0)  # type: ignore[attr-defined]
    accuracy = jax.jit(lambda p, xv, yv: (logits(p, xv).argmax(-1) == yv).mean())

    save_policy = policies.AnyOf(policies.EveryNSteps(args.save_every), policies.OnPreemption())
    keep_policy = policies.KeepAnyOf(policies.KeepLatest(3), policies.KeepBest(1, "val_acc"))
    with ckptstore.CheckpointManager(
        args.target, save_policy=save_policy, keep_policy=keep_policy
    ) as mgr:
        state = fresh_state()
        start_step = 0
        latest = mgr.latest_step()
        if latest is not None:
            like = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
            )
            state = mgr.restore(latest, like=like)
            start_step = latest
            emit(event="resumed", step=latest, digest=digest(state))
        for step in range(start_step + 1, args.steps + 1):
            rng = np.random.default_rng(step)  # batches depend on the step only
            idx = rng.choice(len(x_train), BATCH, replace=False)
            state, loss = step_donating(state, x_train[idx], y_train[idx])
            emit(event="step", step=step)
            val_acc = None
            if step % args.save_every == 0 or mgr.preempted:
                val_acc = float(accuracy(state["params"], x_val, y_val))
                emit(event="progress", step=step, loss=float(loss), val_acc=val_acc)
            t0 = time.perf_counter()
            handle = mgr.save(
                step, state, metrics=None if val_acc is None else {"val_acc": val_acc}
            )
            pause = time.perf_counter() - t0
            if handle is not None:
                t1 = time.perf_counter()
                jax.block_until_ready(jax.device_get(state))  # a plain host copy, for scale
                host_copy = time.perf_counter() - t1
                event = dict(event="save", step=step, pause=pause, host_copy=host_copy)
                if mgr.preempted:
                    event["digest"] = digest(state)
                emit(**event)
            if mgr.preempted:
                mgr.wait_until_finished()
                emit(event="preempted", step=step)
                break
        mgr.wait_until_finished()
        for stats in mgr.stats:
            emit(
                event="durable",
                step=stats.step,
                durable=stats.durable,
                waited=stats.waited,
                staging=stats.staging,
                bytes=stats.bytes,
            )
        emit(
            event="done",
            kept=mgr.all_steps(),
            step=step,
            val_acc=float(accuracy(state["params"], x_val, y_val)),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
