"""One process of a many-process job (run by tests/multiprocess/test_multiprocess_scale.py): one CPU
device per process, joined by jax.distributed.

Usage: scale_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID ROOT MODE
MODE "save" saves `tree` as step 1, its sharded leaves split over every process's device;
"restore" restores step 1 onto this job's devices (whatever their number) and checks every
addressable shard bit for bit.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import numpy as np

#: Leaf shapes: every sharded dimension divides by 48, so 1, 2, 3, 4, 6, 8, 16, 24 and 48
#: processes can each hold an equal share.
SHAPES: dict[str, tuple[int, ...]] = {
    "w": (48, 20),  # sharded along rows
    "m": (6, 96),  # sharded along columns
    "steps": (48,),  # int32, sharded
    "bias": (10,),  # replicated
}
DTYPES = {"w": np.float32, "m": np.float32, "steps": np.int32, "bias": np.float32}


def expected(name: str) -> np.ndarray:
    """The leaf's saved value: random bits (NaNs, negative zeros and all), not just numbers
    that compare equal, so that only a bit-exact round trip passes."""
    rng = np.random.default_rng(sum(map(ord, name)))
    raw = rng.integers(0, 2**32, size=SHAPES[name], dtype=np.uint32)
    return raw.view(DTYPES[name])


def specs(P: Any) -> dict[str, Any]:
    return {"w": P("p", None), "m": P(None, "p"), "steps": P("p"), "bias": P()}


def main() -> None:
    coordinator, num, pid, root, mode = sys.argv[1:6]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # before jax starts
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import ckptstore

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=int(num), process_id=int(pid)
    )
    devices = jax.devices()
    assert len(devices) == int(num), devices
    mesh = Mesh(np.array(devices), ("p",))
    shardings = {k: NamedSharding(mesh, s) for k, s in specs(P).items()}
    if mode == "save":
        tree = {
            k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, k=k: expected(k)[i])
            for k in SHAPES
        }
        result = asyncio.run(ckptstore.save(root, tree, step=1, timeout=120))
        print(f"saved {result.bytes_written} merge {result.timings.get('merge', 0):.3f}")
    else:
        like = {
            k: jax.ShapeDtypeStruct(SHAPES[k], DTYPES[k], sharding=shardings[k]) for k in SHAPES
        }
        out = asyncio.run(ckptstore.restore(root, like=like))
        shards = 0
        for k, arr in out.items():
            assert arr.sharding == shardings[k], (k, arr.sharding)
            assert arr.dtype == DTYPES[k], (k, arr.dtype)
            for shard in arr.addressable_shards:
                got = np.asarray(shard.data)
                assert got.tobytes() == expected(k)[shard.index].tobytes(), (k, shard.index)
                shards += 1
        print(f"restored ok {shards}")
    sys.stdout.flush()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
