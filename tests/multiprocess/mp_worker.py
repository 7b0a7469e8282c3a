"""One process of a multi-process test job (run by tests/multiprocess/test_multiprocess.py).

Usage: mp_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID ROOT MODE
MODE "save" saves a sharded tree as step 1 on a (2, 4) mesh; "partial" builds the same
tree as step 2 through a partial save, one part per leaf; "fail" saves like "save" but
process 1 fails while writing ("fail0": process 0 does; "die": process 1 exits with status
3 once its writes are done, before it reports them, and process 0 waits 8 s for it, then
exits without `jax.distributed.shutdown`, which would wait for the dead one); "late" saves
like "save" but another writer commits step 1 while process 0 merges (every process must
then raise `AlreadyExistsError`); "restore"
restores step 1 on a transposed (4, 2) mesh and checks every addressable shard; "manager"
trains 6 steps (donating the state) with a `CheckpointManager` saving every 2 steps and
keeping 2, then restores the latest on the transposed mesh. Orbax: "orbax-save" saves the
"save" tree with Orbax's StandardCheckpointer into ROOT; "orbax-restore" restores the
Orbax checkpoint at ROOT with Orbax onto the transposed mesh and checks every shard;
"orbax-import" imports the Orbax checkpoint ROOT/orbax into ROOT/imported, step 1.
Tiers (a 6th argument, DURABLE, names the durable tier; each process's fast tier is its own
ROOT/fast<PROCESS_ID>, or with a 7th argument "shared" one ROOT/fast for both):
"tiered-save" saves the "save" tree as step 1 on the tiers, then promotes it (every process),
then (host-local) tries a partial save of step 2 and an incremental manager;
"tiered-restore" restores the latest step from the tiers on the transposed mesh and checks
every shard, then the whole tree as numpy arrays, and prints where each read its step;
"tiered-promote" promotes what is staged; "tiered-manager" runs "manager" on the tiers
(keep_fast=1).
"preempt" resumes from the latest committed step (if any), then trains (x -> x + 1, donating
the state) calling the manager's `save` at every step with saves every 1000 steps or on
preemption, prints "training from STEP" once running and, when the manager says the job is
preempted, "preempted at STEP", and exits once that step is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore

SHAPES = {"w": (16, 24), "v": (8, 8, 3), "replicated": (10,)}


def expected(name: str) -> np.ndarray:
    shape = SHAPES[name]
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * (1 + len(name))


def main() -> None:
    own_stdout()
    coordinator, num, pid, root, mode = sys.argv[1:6]
    durable = sys.argv[6] if len(sys.argv) > 6 else None
    fast = f"{root}/fast" if sys.argv[7:] == ["shared"] else f"{root}/fast{pid}"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before jax starts
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=int(num), process_id=int(pid)
    )
    devices = np.array(jax.devices())
    assert devices.size == 4 * int(num), devices
    if mode == "preempt":
        run_preempt(root, devices)
        jax.distributed.shutdown()
        return
    if mode in ("manager", "tiered-manager"):
        tiers = ckptstore.Tiered(fast, str(durable), keep_fast=1) if durable else None
        run_manager(tiers or root, devices)
        jax.distributed.shutdown()
        return
    if mode == "orbax-import":
        result = asyncio.run(
            ckptstore.import_orbax(f"{root}/orbax", f"{root}/imported", as_step=1, batch_bytes=1)
        )
        print(f"imported {result.leaves} in {result.parts} parts", flush=True)
        jax.distributed.shutdown()
        return
    if mode not in ("restore", "orbax-restore", "tiered-restore"):
        mesh = Mesh(devices.reshape(2, -1), ("x", "y"))
        specs = {"w": P("x", "y"), "v": P("y"), "replicated": P()}
    else:
        mesh = Mesh(devices.reshape(2, -1).T, ("x", "y"))  # transposed device order
        specs = {"w": P("y", "x"), "v": P(None, "x"), "replicated": P()}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}

    if (mode, int(pid)) in (("fail", 1), ("fail0", 0)):
        import ckptstore.datapath.arrays as arrays_module

        async def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("disk on fire")

        arrays_module.write_leaves = broken  # type: ignore[assignment]
    if mode == "die" and int(pid) == 1:
        import ckptstore.datapath.arrays as arrays_module

        real_write = arrays_module.write_leaves

        async def write_then_die(*args, **kwargs):  # type: ignore[no-untyped-def]
            await real_write(*args, **kwargs)
            os._exit(3)  # a crash: no report, no cleanup, no shutdown

        arrays_module.write_leaves = write_then_die
    if mode == "late" and int(pid) == 0:
        import ckptstore.checkpoint.saveplan as saveplan_module

        real_merge = saveplan_module.merge

        async def merge_then_lose(backend, *args, **kwargs):  # type: ignore[no-untyped-def]
            result = await real_merge(backend, *args, **kwargs)
            await backend.create("1/COMMITTED", b'{"step": 1, "by": "someone else"}')
            return result

        saveplan_module.merge = merge_then_lose
    if mode == "partial":
        tree = {
            k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i])
            for k in SHAPES
        }

        async def build() -> None:
            session = await ckptstore.partial_save(root, step=2, timeout=60)
            for k, value in tree.items():  # one part per leaf, each written by both processes
                await session.add({k: value})
            await session.finalize()

        asyncio.run(build())
        print("partial ok", flush=True)
    elif mode == "orbax-save":
        import orbax.checkpoint as ocp

        tree = {
            k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i])
            for k in SHAPES
        }
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(root, tree)
        checkpointer.wait_until_finished()
        checkpointer.close()
        print("orbax saved", flush=True)
    elif mode == "orbax-restore":
        import orbax.checkpoint as ocp

        target = {
            k: jax.ShapeDtypeStruct(SHAPES[k], np.float32, sharding=shardings[k]) for k in SHAPES
        }
        out = ocp.StandardCheckpointer().restore(root, target)
        for k, arr in out.items():
            assert arr.sharding == shardings[k]
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), expected(k)[shard.index])
        print("orbax restored ok", flush=True)
    elif mode == "tiered-save":
        tiers = ckptstore.Tiered(fast, str(durable))
        tree = {
            k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i])
            for k in SHAPES
        }
        saved = asyncio.run(ckptstore.save(tiers, tree, step=1, timeout=60))
        listed = asyncio.run(ckptstore.list_steps(tiers))  # staged, not listed until promoted
        done = asyncio.run(ckptstore.promote(tiers, timeout=60))
        now = asyncio.run(ckptstore.list_steps(tiers))
        promoted = [(p.step, p.copied > 0) for p in done]
        if sys.argv[7:] != ["shared"]:  # host-local: a partial save is refused up front
            try:
                asyncio.run(ckptstore.partial_save(tiers, step=2, timeout=60))
            except ckptstore.UnsupportedOperationError as exc:
                print(f"partial refused: {exc}", flush=True)
            try:  # nor can a manager save incrementally there: refused at construction
                options = ckptstore.ManagerOptions(incremental=True, handle_sigterm=False)
                ckptstore.CheckpointManager(tiers, options=options).close()
            except ckptstore.ConfigError as exc:
                print(f"manager refused: {exc}", flush=True)
        print(
            f"tiered saved {saved.bytes_written} listed {listed} promoted {promoted} now {now}",
            flush=True,
        )
    elif mode == "tiered-promote":
        tiers = ckptstore.Tiered(fast, str(durable))
        done = asyncio.run(ckptstore.promote(tiers, timeout=60))
        print(f"promoted {[(p.step, p.copied) for p in done]}", flush=True)
    elif mode == "tiered-restore":
        tiers = ckptstore.Tiered(fast, str(durable))
        like = {
            k: jax.ShapeDtypeStruct(SHAPES[k], np.float32, sharding=shardings[k]) for k in SHAPES
        }
        with read_from() as sharded:
            out = asyncio.run(ckptstore.restore(tiers, like=like))
        for k, arr in out.items():
            assert arr.sharding == shardings[k]
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), expected(k)[shard.index])
        with read_from() as whole:  # every slice: more than this host's devices held
            out = asyncio.run(ckptstore.restore(tiers))
        for k in SHAPES:
            assert out[k].tobytes() == expected(k).tobytes()
        print(f"tiered restored ok: sharded {sharded[0]}, whole {whole[0]}", flush=True)
    elif mode in ("save", "fail", "fail0", "late", "die"):
        tree = {
            k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i])
            for k in SHAPES
        }
        timeout = 8 if mode == "die" else 60
        try:
            result = asyncio.run(ckptstore.save(root, tree, step=1, timeout=timeout))
        except (ckptstore.CkptStoreError, RuntimeError) as exc:
            print(f"failed: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"saved {result.bytes_written} of {result.bytes}", flush=True)
        if mode == "die":
            os._exit(0)
    else:
        like = {
            k: jax.ShapeDtypeStruct(SHAPES[k], np.float32, sharding=shardings[k]) for k in SHAPES
        }
        out = asyncio.run(ckptstore.restore(root, like=like))
        for k, arr in out.items():
            assert arr.sharding == shardings[k]
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), expected(k)[shard.index])
        print("restored ok", flush=True)
    jax.distributed.shutdown()


@contextlib.contextmanager
def read_from() -> Iterator[list[str]]:
    """Where the restores inside read their step (ckptstore's "read from" log lines)."""
    found: list[str] = []

    class Where(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if " read from " in text:
                found.append(text.split(" read from ", 1)[1])

    logger = logging.getLogger("ckptstore")
    handler, level = Where(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def trained(name: str, steps: int) -> np.ndarray:
    """``expected(name)`` after ``steps`` training steps (x -> 2x + 1, exact in float32)."""
    value = expected(name)
    for _ in range(steps):
        value = value * 2 + 1
    return value


def run_manager(root: str | ckptstore.Tiered, devices: np.ndarray) -> None:
    from ckptstore import policies

    mesh = Mesh(devices.reshape(2, -1), ("x", "y"))
    specs = {"w": P("x", "y"), "v": P("y"), "replicated": P()}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    state = {
        k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i])
        for k in SHAPES
    }
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    # EveryNSeconds makes the policy clock-dependent: process 0 decides for both.
    save = policies.AnyOf(policies.EveryNSteps(2), policies.EveryNSeconds(3600))
    opts = ckptstore.ManagerOptions(timeout=60, handle_sigterm=False)
    with ckptstore.CheckpointManager(
        root, save_policy=save, keep_policy=policies.KeepLatest(2), options=opts
    ) as mgr:
        saved = []
        for step in range(1, 7):
            if mgr.save(step, state) is not None:
                saved.append(step)
            state = step_fn(state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4, 6], mgr.all_steps()
        transposed = Mesh(devices.reshape(2, -1).T, ("x", "y"))
        new_specs = {"w": P("y", "x"), "v": P(None, "x"), "replicated": P()}
        like = {
            k: jax.ShapeDtypeStruct(SHAPES[k], np.float32, sharding=NamedSharding(transposed, s))
            for k, s in new_specs.items()
        }
        with read_from() as where:  # tiers only
            out = mgr.restore(like=like)
        for k, arr in out.items():
            for shard in arr.addressable_shards:  # step 6 holds the state after 5 steps
                np.testing.assert_array_equal(np.asarray(shard.data), trained(k, 5)[shard.index])
    print(f"manager ok saved {saved}" + "".join(f", read {w}" for w in where), flush=True)


def run_preempt(root: str, devices: np.ndarray) -> None:
    import time

    from ckptstore import policies

    mesh = Mesh(devices.reshape(2, -1), ("x", "y"))
    specs = {"w": P("x", "y"), "v": P("y"), "replicated": P()}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    save = policies.AnyOf(policies.EveryNSteps(1000), policies.OnPreemption())
    opts = ckptstore.ManagerOptions(timeout=60)  # SIGTERM: JAX's preemption service
    with ckptstore.CheckpointManager(root, save_policy=save, options=opts) as mgr:
        start = mgr.latest_step() or 0
        if start:  # the state saved at step S is expected + S
            like = {
                k: jax.ShapeDtypeStruct(SHAPES[k], np.float32, sharding=shardings[k])
                for k in SHAPES
            }
            state = mgr.restore(like=like)
            for k, arr in state.items():
                for shard in arr.addressable_shards:
                    want = expected(k)[shard.index] + start
                    np.testing.assert_array_equal(np.asarray(shard.data), want)
        else:
            state = {
                k: jax.make_array_from_callback(
                    SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i]
                )
                for k in SHAPES
            }
        print(f"training from {start}", flush=True)
        for step in range(start + 1, start + 20_000):
            state = step_fn(state)
            mgr.save(step, state)
            if mgr.preempted:
                print(f"preempted at {step}", flush=True)
                break
            time.sleep(0.005)
        else:
            raise AssertionError("never preempted")


def own_stdout() -> None:
    """Keep stdout for what this worker prints: Gloo (JAX's CPU collectives) writes its
    connection messages to file descriptor 1 at any moment, even mid-line, so fd 1 goes to
    stderr and Python's stdout to a private copy of the pipe the test reads."""
    sys.stdout.flush()
    mine = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(mine, "w", buffering=1)


if __name__ == "__main__":
    main()
