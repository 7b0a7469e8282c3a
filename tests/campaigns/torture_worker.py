"""The processes the torture campaign (tests/campaigns/torture.py) kills: one operation each.

A worker is forked from a zygote that already imported ckptstore, JAX and TensorStore
(a multiprocessing forkserver), so a kill point costs a fork instead of an interpreter
start. It runs one operation on a target (a path or an S3 profile), and reports every
phase it enters and leaves on a pipe: ``(process, phase, "start" | "end", time, n)``
with ``time.monotonic()`` (one clock for every process on the machine), and finally
``(process, "done", "end", time, 0)`` or ``(process, "error", text, time, typed)``.
Phases: "save", "add" (``n``: the part index), "finalize", "delete", "gc", and inside
them "merge" and "commit" (hooks around the modules' own functions); inside an
incremental save (``base=``) also "unchanged" (reading the base, digesting the candidate
leaves, "digest", and the processes' agreement round) and, inside "commit", "check_base"
(the re-check of the base before the marker). A job with ``stop`` stops at that exact
point (`tests.campaigns.killpoints.STOPS`) after sending ``(process, "stop", "start",
time, 0)``, for the driver to kill it there.

The trees are pure functions of the step and the kind (`KINDS`), so the driver knows what
every committed step must restore to, bit for bit. The incremental kinds have frozen
leaves, the same at every step, beside leaves that change with it; the single-process one
also a leaf that changes in one row per step, saved in small chunks (`CHUNK_BYTES`), so
that an incremental save writes two of its chunks as raw keys and references the rest
(`ckptstore.datapath.chunkwrites`, docs/incremental.md "Chunk references"); on odd steps
it declares those rows (``changed=``), its chunks hashed and written in one pass
(`ckptstore.datapath.declaredwrites`).
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
#: The incremental kinds' multi-process tree: frozen leaves (the same at every step) and
#: live ones, sharded over the two processes' (2, 2) mesh or replicated.
SHARDED_INC = {"frozen_w": (128, 96), "frozen_v": (64, 48), "live_w": (64, 32), "count": (4,)}
SPECS = {"w": ("x", "y"), "v": ("y",), "replicated": ()}
SPECS |= {"frozen_w": ("x", "y"), "frozen_v": ("y",), "live_w": ("x",), "count": ()}
#: What a committed step holds: the tree of one process or the sharded tree of two, each
#: plain or with frozen leaves (saved with ``base=`` by the incremental operations).
KINDS = ("tree", "sharded", "inc", "inc-sharded")
FROZEN_SEED = 2**31  # the frozen leaves' values: the same whatever the step
#: The incremental kinds' chunk size, in every save of theirs (a base too: the chunk
#: shapes must match): "rows" (256 x 64 float32) in 16 chunks of 32 x 32.
CHUNK_BYTES = 4096


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


def inc_tree(step: int) -> dict[str, Any]:
    """The single-process tree of the incremental kind: frozen leaves (two large ones and
    a small one, which goes into a pack), leaves that change with ``step``, and a table
    whose row ``step % 256`` alone is ``step`` (two saves differ in two of its chunks)."""
    frozen = np.random.default_rng(FROZEN_SEED)
    live = np.random.default_rng(step)
    rows = np.random.default_rng(FROZEN_SEED + 1).standard_normal((256, 64)).astype(np.float32)
    rows[step % 256] = step
    return {
        "rows": rows,
        "frozen": {
            "w0": frozen.standard_normal((256, 64)).astype(np.float32),
            "w1": frozen.standard_normal((128, 64)).astype(np.float32),
            "norm": frozen.standard_normal(64).astype(np.float32),
        },
        "live": {
            "a": live.standard_normal((64, 32)).astype(np.float32),
            "count": np.full(4, step, np.int64),
        },
    }


def sharded_value(step: int, name: str) -> np.ndarray[Any, Any]:
    """The whole value of leaf ``name`` of a multi-process tree saved as ``step`` (a
    frozen one's is the same at every step)."""
    shape = SHARDED[name] if name in SHARDED else SHARDED_INC[name]
    scale = 1 if name.startswith("frozen") else step + 1
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * scale + len(name)


def sharded_tree(step: int, names: Any = SHARDED) -> dict[str, np.ndarray[Any, Any]]:
    return {name: sharded_value(step, name) for name in names}


def expected(step: int, kind: str) -> dict[str, Any]:
    """What step ``step`` of ``kind`` restores to."""
    if kind == "tree":
        return tree(step)
    if kind == "inc":
        return inc_tree(step)
    return sharded_tree(step, SHARDED_INC if kind == "inc-sharded" else SHARDED)


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

    def wrap(self, module: Any, attr: str, phase: str = "") -> None:
        real: Callable[..., Awaitable[Any]] = getattr(module, attr)

        async def hooked(*args: Any, **kwargs: Any) -> Any:
            return await self.phase(phase or attr, real(*args, **kwargs))

        setattr(module, attr, hooked)


async def run_op(job: dict[str, Any], rep: Reporter, value: Callable[[int], Any]) -> None:
    """One operation of the campaign; ``value(step)`` is the tree to save."""
    import ckptstore

    op, target, step = job["op"], job["target"], job["step"]
    timeout = float(job.get("timeout", 30))
    await asyncio.sleep(float(job.get("delay", 0)))  # a race's actor starting later
    if op in ("save", "merge", "commit", "inc", "inc-at", "race-save"):
        base = job.get("base")
        chunks = CHUNK_BYTES if str(job.get("kind", "")).startswith("inc") else None
        changed = None
        if job.get("kind") == "inc" and base is not None and step % 2:
            # Half of them declare the rows that differ from the base (`inc_tree`), so that
            # kills land in a declared save's write too (`datapath.declaredwrites`).
            changed = {"rows": sorted({base % 256, step % 256})}
        work = ckptstore.save(
            target,
            value(step),
            step=step,
            timeout=timeout,
            base=base,
            changed=changed,
            chunk_bytes=chunks,
        )
        await rep.phase("save", work)
    elif op in ("add", "finalize"):
        session = await ckptstore.partial_save(target, step, timeout=timeout)
        names = list(value(step))  # a part per top-level key (multi-process: per leaf)
        for k in range(len(session.parts), len(names)):
            name = names[k]
            await rep.phase("add", session.add({name: value(step)[name]}), k)
        await rep.phase("finalize", session.finalize())
    elif op in ("delete", "delete-ref", "race-delete"):
        await rep.phase("delete", ckptstore.delete_step(target, step))
    elif op in ("gc", "race-gc"):
        await rep.phase("gc", ckptstore.gc(target, older_than=float(job.get("grace", 0))))
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
        import ckptstore.checkpoint.incremental as incremental_module
        import ckptstore.checkpoint.parts as parts_module
        import ckptstore.checkpoint.save as save_module
        import ckptstore.checkpoint.saveplan as saveplan_module
        import ckptstore.protocol.attempt as attempt_module
        from tests.campaigns.killpoints import install_stop

        for module in (saveplan_module, parts_module):  # a save's merge, a finalize's
            rep.wrap(module, "merge")
        rep.wrap(attempt_module.Attempt, "commit")  # a save's and a finalize's
        rep.wrap(save_module, "unchanged")
        rep.wrap(incremental_module, "piece_table", "digest")
        rep.wrap(attempt_module, "check_base")
        if job.get("stop"):
            install_stop(job["stop"], lambda name: rep.send("stop", "start"))
        if job.get("processes", 1) == 1:
            kind = job.get("kind", "tree")
            asyncio.run(run_op(job, rep, lambda step: expected(step, kind)))
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
    names = SHARDED_INC if job.get("kind") == "inc-sharded" else SHARDED

    def value(step: int) -> dict[str, Any]:
        out = {}
        for name in names:
            whole = sharded_value(step, name)
            out[name] = jax.make_array_from_callback(
                whole.shape, NamedSharding(mesh, P(*SPECS[name])), lambda i, w=whole: w[i]
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
