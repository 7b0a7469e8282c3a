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
)

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
    return {}


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
    else:
        raise ValueError(f"unknown shape {shape!r}")


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
