"""One process of a multi-process incremental save (run by
tests/multiprocess/test_multiprocess_incremental.py): one CPU device per process, joined by
jax.distributed.

Usage: incremental_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID ROOT

Saves `tree` five times: step 1 in full; step 2 with ``base=1`` and the same values
(every leaf unchanged); step 3 with ``base=2`` where one element of the LAST process's
shard of "w" changed, on that process only (the others build the very same values as
before: "w" is written in part, by that process alone); step 4 as a partial save with
``base=3``, one part per leaf, where one element of process 0's shard of "m" changed, on
process 0 only; step 5 with ``base=3`` and ``changed={"w": [DECLARED row]}``, where "w"
changed in the declared row (the last process's shard) and, undeclared, in process 0's.
Prints one JSON line per save: its step, the bytes this process wrote, and the bytes
referenced (and for step 4, the leaves each part referenced).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import numpy as np

from tests.multiprocess.scale_worker import DTYPES, SHAPES, specs
from tests.multiprocess.scale_worker import expected as scale_expected

#: A host numpy leaf beside the jax.Arrays (process 0 writes it).
HOST = np.arange(30, dtype=np.int64).reshape(5, 6) * 7
#: The element of "w" step 3 changes: in the last row, which the last process holds.
CHANGED = (47, 3)
#: The element of "m" step 4 changes: in the first column, which process 0 holds.
CHANGED_M = (2, 0)
#: The elements of "w" step 5 changes: one in a row it declares (the last process's shard),
#: one in a row it does not (process 0's), which step 5 therefore keeps as step 3 saved it.
DECLARED, UNDECLARED = (46, 4), (0, 0)


def expected(name: str, step: int) -> np.ndarray:
    """Leaf ``name`` as step ``step`` saved it."""
    if name == "host":
        return HOST
    value = scale_expected(name).copy()
    if name == "w" and step >= 3:
        value[CHANGED] = np.float32(-1.5)
    if name == "m" and step >= 4:
        value[CHANGED_M] = np.float32(2.5)
    if name == "w" and step >= 5:
        value[DECLARED], value[UNDECLARED] = np.float32(4.5), np.float32(5.5)
    return value


def main() -> None:
    coordinator, num, pid, root = sys.argv[1:5]
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

    def tree(step: int) -> dict[str, Any]:
        return {
            **{
                k: jax.make_array_from_callback(
                    SHAPES[k], shardings[k], lambda i, k=k: expected(k, step)[i]
                )
                for k in SHAPES
            },
            "host": HOST.copy(),
        }

    async def run() -> None:
        for step, base in ((1, None), (2, 1), (3, 2)):
            # Step 3 changes "w" only where the last process builds it (so it is written in
            # part): a process's callback is called for its own shards alone.
            result = await ckptstore.save(root, tree(step), step=step, base=base, timeout=120)
            print(
                json.dumps(
                    {
                        "step": step,
                        "written": result.bytes_written,
                        "referenced": result.bytes_referenced,
                        "bytes": result.bytes,
                    }
                ),
                flush=True,
            )

    async def partial() -> None:
        session = await ckptstore.partial_save(root, step=4, base=3, timeout=120)
        parts = [sorted((await session.add({k: v})).refs) for k, v in tree(4).items()]
        result = await session.finalize()
        report = {"written": result.bytes_written, "referenced": result.bytes_referenced}
        print(json.dumps({"step": 4, **report, "bytes": result.bytes, "parts": parts}))

    async def declared() -> None:
        changed = {"w": [DECLARED[0]]}
        result = await ckptstore.save(root, tree(5), step=5, base=3, changed=changed, timeout=120)
        report = {"written": result.bytes_written, "referenced": result.bytes_referenced}
        print(json.dumps({"step": 5, **report, "bytes": result.bytes}), flush=True)

    asyncio.run(run())
    asyncio.run(partial())
    asyncio.run(declared())
    sys.stdout.flush()
    jax.distributed.shutdown()


__all__ = ["DTYPES", "SHAPES", "expected"]

if __name__ == "__main__":
    main()
