"""The processes the torture campaign (tests/campaigns/torture.py) kills: one operation each.

A worker is forked from a zygote that already imported ckptstore, JAX and TensorStore
(a multiprocessing forkserver), so a kill point costs a fork instead of an interpreter
start. It runs one operation on a target (a path or an S3 profile), and reports every
phase it enters and leaves on a pipe: ``(process, phase, "start" | "end", time, n)``
with ``time.monotonic()`` (one clock for every process on the machine), and finally
``(process, "done", "end", time, 0)`` or ``(process, "error", text, time, typed)``.
Phases: "save", "add" (``n``: the part index), "finalize", "delete", "gc", and inside
them "merge" and "commit" (hooks around the modules' own functions).

The trees are pure functions of the step, so the driver knows what every committed
step must restore to, bit for bit.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

#: Modules the zygote imports before forking workers.
PRELOAD = [
    "tests.campaigns.torture_zygote",
    "tests.campaigns.torture_worker",
    "ckptstore.checkpoint.save",
    "ckptstore.checkpoint.partial",
    "ckptstore.checkpoint.cleanup",
    "ckptstore.tiers.read",
    "ckptstore.backends.s3",
    "s3fs",
    "jax",
]

PARTS = 4
SHARDED = {"w": (128, 96), "v": (64, 48), "replicated": (40,)}  # multi-process trees


def tree(step: int) -> dict[str, Any]:
    """The single-process tree saved as ``step``: PARTS layers of two leaves (a partial
    save writes layer k as part k)."""
    rng = np.random.default_rng(step)
    return {
        str(k): {
            "w": rng.standard_normal((128, 64)).astype(np.float32),
            "b": np.full(64, step * 10 + k, np.int32),
        }
        for k in range(PARTS)
    }


def sharded_value(step: int, name: str) -> np.ndarray[Any, Any]:
    """The whole value of leaf ``name`` of the multi-process tree saved as ``step``."""
    shape = SHARDED[name]
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * (step + 1) + len(name)


def sharded_tree(step: int) -> dict[str, np.ndarray[Any, Any]]:
    return {name: sharded_value(step, name) for name in SHARDED}


def flat(tree: Any, prefix: str = "") -> dict[str, np.ndarray[Any, Any]]:
    """Leaves by slash-joined path, as numpy arrays."""
    if isinstance(tree, dict):
        out: dict[str, np.ndarray[Any, Any]] = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): np.asarray(tree)}


def same(restored: Any, expected: Any) -> bool:
    """Same leaves, dtypes, shapes and bytes."""
    a, b = flat(restored), flat(expected)
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a
    )


class Reporter:
    """Sends phase events to the driver; installed around the modules' merge and commit."""

    def __init__(self, conn: Connection, process: int) -> None:
        self.conn = conn
        self.process = process

    def send(self, phase: str, edge: str, n: int = 0) -> None:
        self.conn.send((self.process, phase, edge, time.monotonic(), n))

    async def phase(self, name: str, work: Awaitable[Any], n: int = 0) -> Any:
        self.send(name, "start", n)
        result = await work
        self.send(name, "end", n)
        return result

    def wrap(self, module: Any, attr: str) -> None:
        real: Callable[..., Awaitable[Any]] = getattr(module, attr)

        async def hooked(*args: Any, **kwargs: Any) -> Any:
            return await self.phase(attr, real(*args, **kwargs))

        setattr(module, attr, hooked)


async def run_op(job: dict[str, Any], rep: Reporter, value: Callable[[int], Any]) -> None:
    """One operation of the campaign; ``value(step)`` is the tree to save."""
    import ckptstore

    op, target, step = job["op"], job["target"], job["step"]
    timeout = float(job.get("timeout", 30))
    if op in ("save", "merge", "commit"):
        await rep.phase("save", ckptstore.save(target, value(step), step=step, timeout=timeout))
    elif op in ("add", "finalize"):
        session = await ckptstore.partial_save(target, step, timeout=timeout)
        names = list(value(step))  # a part per top-level key (multi-process: per leaf)
        for k in range(len(session.parts), len(names)):
            name = names[k]
            await rep.phase("add", session.add({name: value(step)[name]}), k)
        await rep.phase("finalize", session.finalize())
    elif op == "delete":
        await rep.phase("delete", ckptstore.delete_step(target, step))
    elif op == "gc":
        await rep.phase("gc", ckptstore.gc(target, older_than=0))
    else:
        raise ValueError(f"unknown operation {op!r}")


def run(conn: Connection, job: dict[str, Any]) -> None:
    """A worker's body (the target of a forked process)."""
    os.environ.update(job.get("env", {}))
    if job.get("log"):  # C++ logs (a dying peer's JAX client, the AWS SDK) go there
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    process = int(job.get("process", 0))
    rep = Reporter(conn, process)
    try:
        import ckptstore.checkpoint.partial as partial_module
        import ckptstore.checkpoint.save as save_module

        for module in (save_module, partial_module):
            rep.wrap(module, "merge")
            rep.wrap(module, "commit")
        if job.get("processes", 1) == 1:
            asyncio.run(run_op(job, rep, tree))
        else:
            _run_distributed(job, rep)
    except BaseException as exc:  # reported: n is 1 for a typed error (`CkptStoreError`)
        from ckptstore.errors import CkptStoreError

        text = "".join(traceback.format_exception_only(exc)).strip()[-2000:]
        typed = isinstance(exc, CkptStoreError)
        conn.send((process, "error", text, time.monotonic(), int(typed)))
        return
    rep.send("done", "end")


def _run_distributed(job: dict[str, Any], rep: Reporter) -> None:
    """Join the job's other processes with jax.distributed, then run the operation with
    sharded jax arrays (a (2, 2) mesh over the two processes' devices)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(
        coordinator_address=job["coordinator"],
        num_processes=int(job["processes"]),
        process_id=rep.process,
        initialization_timeout=60,
    )
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("x", "y"))
    specs = {"w": P("x", "y"), "v": P("y"), "replicated": P()}

    def value(step: int) -> dict[str, Any]:
        out = {}
        for name, spec in specs.items():
            whole = sharded_value(step, name)
            out[name] = jax.make_array_from_callback(
                whole.shape, NamedSharding(mesh, spec), lambda i, w=whole: w[i]
            )
        return out

    asyncio.run(run_op(job, rep, value))
    jax.distributed.shutdown()


class Zygote:
    """A forkserver with ckptstore, JAX and TensorStore imported: a worker is one fork."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)

    def start(self, jobs: list[dict[str, Any]]) -> tuple[list[Any], Connection]:
        receive, send = self.ctx.Pipe(duplex=False)
        procs = [self.ctx.Process(target=run, args=(send, job)) for job in jobs]
        for p in procs:
            p.start()
        send.close()
        return procs, receive

    def stop(self) -> None:
        """Stop the forkserver (else it lives as long as this process); a private hook of
        multiprocessing, skipped where it is missing."""
        from multiprocessing import forkserver

        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()
