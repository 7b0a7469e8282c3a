"""One of two OS processes playing the actors of a commit-protocol race, round after round
(tests/campaigns/test_fate_races.py; `make races` runs 50 rounds of every shape).

Each round: both processes meet at a barrier; process 0 sets the round up (a partial-save
session with two parts, or a committed step on a fast tier) and writes what the other
needs to ``<workdir>/<shape>-<round>.json``; they meet again, each waits a random few
milliseconds, acts, and reports "ok", "typed <Error>" or "untyped <Error>: ...".
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = (
    "finalize-finalize",  # a zombie and its successor finalize one session
    "abandon-finalize",  # the zombie abandons while the successor finalizes
    "gc-idle-finalize",  # gc at 600 s while a session idle for an hour is finalized
    "gc-save",  # gc with a grace of 1 ms while a save runs
    "two-managers",  # two managers save one step; the second starts with a 50 ms gc grace
    "delete-promote",  # delete_step on tiers while the step is promoted
    "delete-resave",  # delete_step, while another job deletes the step and saves it again
    "keep-rm",  # a manager's keep policy drops the step while `ckptstore rm` deletes it
    "replace-base",  # an incremental manager saves on a base another job saves again
)
#: The later step each round's manager saves in "keep-rm" and "replace-base".
LATER = 500

PARTS = [{"a": np.arange(1000, dtype=np.float32)}, {"b": np.arange(500, dtype=np.int32)}]
JITTER = 0.03  # seconds: each actor starts within this of the other


def tree(role: int, step: int) -> dict[str, Any]:
    return {"w": np.full(2048, role + 10 * step, np.float32), "step": np.int64(step)}


def parts_tree() -> dict[str, Any]:
    return {**PARTS[0], **PARTS[1]}


def fast_dir(workdir: str) -> str:
    return os.path.join(workdir, "fast")


async def setup(shape: str, target: str, workdir: str, step: int) -> dict[str, Any]:
    import ckptstore

    if shape in ("finalize-finalize", "abandon-finalize", "gc-idle-finalize"):
        session = await ckptstore.partial_save(target, step)
        for part in PARTS:
            await session.add(part)
        await session.close()
        if shape == "gc-idle-finalize" and not target.endswith(".toml"):
            hour_ago = time.time() - 3600  # idle for an hour (local disk: set the times)
            for path in Path(target, str(step), session.attempt).rglob("*"):
                os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)
        return {"attempt": session.attempt}
    if shape == "delete-promote":
        await ckptstore.save(fast_dir(workdir), tree(0, step), step=step)
    if shape in ("delete-resave", "keep-rm"):
        await ckptstore.save(target, tree(0, step), step=step)
    return {}


def record(workdir: str, shape: str, step: int, role: int, doc: dict[str, Any]) -> None:
    """What an actor did, for the judge (`test_fate_races.judge`)."""
    Path(workdir, f"{shape}-{step}-{role}.json").write_text(json.dumps(doc))


async def act(shape: str, role: int, target: str, workdir: str, step: int, info: dict) -> None:
    import ckptstore

    if shape in ("finalize-finalize", "abandon-finalize", "gc-idle-finalize"):
        if shape == "gc-idle-finalize" and role == 0:
            grace = 0.0 if target.endswith(".toml") else 600.0  # objects' times cannot be set
            await ckptstore.gc(target, older_than=grace)
            return
        session = await ckptstore.partial_save(target, step, attempt=info["attempt"])
        try:
            if shape == "abandon-finalize" and role == 0:
                await session.abandon()
            else:
                await session.finalize()
        finally:
            await session.close()
    elif shape == "gc-save":
        if role == 0:
            for _ in range(3):
                await ckptstore.gc(target, older_than=0.001)
        else:
            await ckptstore.save(target, tree(role, step), step=step)
    elif shape == "two-managers":
        options = ckptstore.ManagerOptions(gc_grace=0.05) if role == 1 else None
        manager = await asyncio.to_thread(ckptstore.CheckpointManager, target, options=options)
        try:
            await asyncio.to_thread(lambda: manager.save(step, tree(role, step)).wait())
        finally:
            await asyncio.to_thread(manager.close)
    elif shape == "delete-promote":
        tiers = ckptstore.Tiered(fast_dir(workdir), target)
        if role == 0:
            await ckptstore.promote(tiers, step=step)
        else:
            await ckptstore.delete_step(tiers, step)
    elif shape == "delete-resave":
        await delete_resave(role, target, workdir, step)
    elif shape == "keep-rm":
        if role == 0:
            keep = ckptstore.policies.KeepLatest(1)
            manager = await asyncio.to_thread(ckptstore.CheckpointManager, target, keep_policy=keep)
            try:
                await asyncio.to_thread(lambda: manager.save(step + LATER, tree(0, step)).wait())
            finally:
                await asyncio.to_thread(manager.close)  # the keep policy's error would raise
        else:
            await ckptstore.delete_step(target, step)
    elif shape == "replace-base":
        await replace_base(role, target, step)
    else:
        raise ValueError(f"unknown shape {shape!r}")


async def delete_resave(role: int, target: str, workdir: str, step: int) -> None:
    """Role 0 deletes the step; role 1 deletes it too (or finds it gone) and saves it again.
    Each records what it removed or committed: role 0 may remove role 1's commit only by
    having read its marker (then its removal names role 1's attempt)."""
    import ckptstore

    if role == 0:
        removal = await ckptstore.delete_step(target, step)
        record(workdir, "delete-resave", step, role, {"removed": removal.entries})
        return
    try:
        await ckptstore.delete_step(target, step)
    except ckptstore.CheckpointNotFoundError:
        pass  # role 0 was first: the goal holds
    result = await ckptstore.save(target, tree(1, step), step=step)
    record(workdir, "delete-resave", step, role, {"attempt": result.attempt})


async def replace_base(role: int, target: str, step: int) -> None:
    """Role 0: an incremental manager saves ``step`` and then ``step + LATER`` from the same
    arrays; role 1, once ``step`` is committed, replaces it with other values."""
    import ckptstore

    if role == 0:
        options = ckptstore.ManagerOptions(incremental=True, handle_sigterm=False)
        manager = await asyncio.to_thread(ckptstore.CheckpointManager, target, options=options)
        arrays = frozen_tree(0, step)
        try:
            await asyncio.to_thread(lambda: manager.save(step, arrays).wait())
            await asyncio.sleep(random.uniform(0, 4 * JITTER))
            await asyncio.to_thread(lambda: manager.save(step + LATER, arrays).wait())
        finally:
            await asyncio.to_thread(manager.close)
        return
    deadline = time.monotonic() + 120
    while step not in await ckptstore.list_steps(target):
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was never committed")
        await asyncio.sleep(0.005)
    await ckptstore.delete_step(target, step)
    await ckptstore.save(target, frozen_tree(1, step), step=step)


def frozen_tree(role: int, step: int) -> dict[str, Any]:
    """`tree`, as JAX arrays (the manager vouches for the very objects it saved)."""
    import jax.numpy as jnp

    return {k: jnp.asarray(v) for k, v in tree(role, step).items()}


def run(
    role: int,
    shapes: list[str],
    targets: dict[str, str],
    workdir: str,
    rounds: int,
    barrier: Barrier,
    results: Queue[Any],
) -> None:
    import ckptstore

    rng = random.Random(role * 7919 + rounds)
    for k, shape in enumerate(shapes):
        for r in range(rounds):
            step = 1000 * (k + 1) + r
            note = Path(workdir, f"{shape}-{r}.json")
            barrier.wait(timeout=300)
            if role == 0:
                info = asyncio.run(setup(shape, targets[shape], workdir, step))
                note.write_text(json.dumps(info))
            barrier.wait(timeout=300)
            info = json.loads(note.read_text())
            time.sleep(rng.uniform(0, JITTER))
            try:
                asyncio.run(act(shape, role, targets[shape], workdir, step, info))
                outcome = "ok"
            except ckptstore.CkptStoreError as exc:
                outcome = f"typed {type(exc).__name__}"
            except Exception as exc:  # reported: the test fails on it
                outcome = f"untyped {type(exc).__name__}: {exc}"
            results.put((shape, step, role, outcome))
