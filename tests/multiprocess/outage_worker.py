"""One process of a two-process tiered training job through an outage of its durable tier
(run by tests/multiprocess/test_multiprocess_outage.py).

Usage: outage_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID ROOT ENDPOINT BUCKET FAST
The durable tier is the S3 bucket BUCKET behind ENDPOINT (a `FaultProxy` the test turns on
and off); the fast tier is ROOT/fast<PROCESS_ID> (FAST "own": each host's disk) or ROOT/fast
(FAST "shared"). The job saves steps 1-2, prints "up" and waits for a line on stdin (the
test takes the durable tier away); saves steps 3-7, each within `BOUND` seconds, opens a
second manager on the same tiers, restores the latest step it lists with it, prints "down"
with what both see, and waits again (the test brings the durable tier back); saves step 8
and prints "back" with what waits.
FAST "split": one fast tier both share, and the durable tier answers process 0 only (process
1 reaches it through a closed port); step 5, committed there, is saved again: each process
prints how that save was refused. FAST "stage" (the durable tier down from the start, each
host's own fast tier) stages steps 1-3; FAST "resume" (it is back) resumes from the latest
step every host staged, saves step 4 and prints what the tiers list then. FAST "slow" (one
shared fast tier, the durable tier's marker writes slowed past the manager's 5 s timeout)
saves step 1 and prints what the tiers list once it is promoted. FAST "open" (as "stage")
opens a manager and prints what it lists.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends.s3 import S3Backend
from ckptstore.testing.servers import free_port
from tests.multiprocess.mp_worker import own_stdout
from tests.tiers.helpers import impatient_s3

#: Seconds one save may take while the durable tier is down (generous: a loaded machine).
BOUND = 30.0


def main() -> None:
    own_stdout()
    logging.basicConfig(level=logging.INFO)  # to stderr: the test reads where restores read
    coordinator, num, pid, root, endpoint, bucket, fast_kind = sys.argv[1:8]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # before jax starts
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=int(num), process_id=int(pid))
    fast = f"{root}/fast" if fast_kind in ("shared", "split", "slow") else f"{root}/fast{pid}"
    if fast_kind == "split" and pid == "1":
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tiers = ckptstore.Tiered(fast, impatient_s3(bucket, endpoint))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))

    def state(step: int) -> dict[str, jax.Array]:
        values = np.arange(64, dtype=np.float32) + step
        return {"w": jax.make_array_from_callback((64,), sharding, lambda i: values[i])}

    if fast_kind in ("stage", "open"):
        tiers = ckptstore.Tiered(fast, impatient_s3(bucket, f"http://127.0.0.1:{free_port()}"))
    if fast_kind == "slow":  # an S3 client that waits for slow answers
        durable = S3Backend(bucket, "run", endpoint_url=endpoint, credentials="env")
        tiers = ckptstore.Tiered(fast, durable)
    if fast_kind in MODES:
        MODES[fast_kind](tiers, state, sharding)
        jax.distributed.shutdown()
        return
    options = ckptstore.ManagerOptions(timeout=60, handle_sigterm=False)
    keep = ckptstore.policies.KeepLatest(3)
    with ckptstore.CheckpointManager(tiers, keep_policy=keep, options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()
        print("up", flush=True)
        sys.stdin.readline()
        for step in range(3, 8):
            start = time.monotonic()
            mgr.save(step, state(step), force=True).wait()  # type: ignore[union-attr]
            assert time.monotonic() - start < BOUND, (step, time.monotonic() - start)
        mgr.wait_until_finished()
        lag = sorted(mgr.unpromoted)
        again = ckptstore.CheckpointManager(tiers, keep_policy=keep, options=options)
        listed = again.all_steps()
        like = {"w": jax.ShapeDtypeStruct((64,), np.float32, sharding=sharding)}
        restored = again.restore(like=like)  # the latest, as a restarted job asks
        for shard in restored["w"].addressable_shards:
            want = np.arange(64, dtype=np.float32)[shard.index] + listed[-1]
            np.testing.assert_array_equal(np.asarray(shard.data), want)
        again.close()
        print(f"down unpromoted {lag} reopened {listed} restored {listed[-1]}", flush=True)
        sys.stdin.readline()
        mgr.save(8, state(8), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()
        print(f"back unpromoted {sorted(mgr.unpromoted)} steps {mgr.all_steps()}", flush=True)
    jax.distributed.shutdown()


State = Callable[[int], dict[str, jax.Array]]
OPTIONS = ckptstore.ManagerOptions(timeout=20, handle_sigterm=False)


def save_again(tiers: ckptstore.Tiered, state: State, sharding: NamedSharding) -> None:
    """Save step 5, committed on the durable tier, through a manager: how it is refused."""
    with ckptstore.CheckpointManager(tiers, options=OPTIONS) as mgr:
        try:
            mgr.save(5, state(5), force=True).wait()  # type: ignore[union-attr]
        except ckptstore.errors.CkptStoreError as exc:
            print(f"refused: {type(exc).__name__}", flush=True)
        else:
            print("saved", flush=True)


def stage(tiers: ckptstore.Tiered, state: State, sharding: NamedSharding) -> None:
    with ckptstore.CheckpointManager(tiers, options=OPTIONS) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()
        print(f"staged, unpromoted {sorted(mgr.unpromoted)}", flush=True)


def resume(tiers: ckptstore.Tiered, state: State, sharding: NamedSharding) -> None:
    with ckptstore.CheckpointManager(tiers, options=OPTIONS) as mgr:
        listed = mgr.all_steps()
        like = {"w": jax.ShapeDtypeStruct((64,), np.float32, sharding=sharding)}
        restored = mgr.restore(like=like)
        for shard in restored["w"].addressable_shards:
            expected = np.arange(64, dtype=np.float32)[shard.index] + listed[-1]
            np.testing.assert_array_equal(np.asarray(shard.data), expected)
        mgr.save(4, state(4), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()
        print(f"resumed {listed}, then {mgr.all_steps()}", flush=True)


def slow(tiers: ckptstore.Tiered, state: State, sharding: NamedSharding) -> None:
    options = ckptstore.ManagerOptions(timeout=5, handle_sigterm=False)
    with ckptstore.CheckpointManager(tiers, options=options) as mgr:
        mgr.save(1, state(1), force=True).wait()  # type: ignore[union-attr]
        mgr.wait_until_finished()  # its promotion, which process 0 does for both
        print(f"promoted, listed {mgr.all_steps()}", flush=True)


def open_only(tiers: ckptstore.Tiered, state: State, sharding: NamedSharding) -> None:
    with ckptstore.CheckpointManager(tiers, options=OPTIONS) as mgr:
        print(f"opened, listed {mgr.all_steps()}", flush=True)


MODES = {
    "split": save_again,
    "stage": stage,
    "resume": resume,
    "slow": slow,
    "open": open_only,
}


if __name__ == "__main__":
    main()
