"""The torture campaign's incremental operations (tests/campaigns/torture.py): the bases
they save on, the race (and the pause) of a save against the deletion of its base and a
gc, and what is checked after a kill and at the end beyond the plain operations' checks.

An incremental step (``save(..., base=B)``) references the attempt holding its frozen
leaves (docs/incremental.md); deleting that attempt's own step must keep its bytes while a
committed step references them, and `gc` must free them once none does.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.format import layout
from ckptstore.testing.servers import free_port
from tests.campaigns import torture_worker as worker
from tests.campaigns.torture_refs import everything, manifests
from tests.campaigns.torture_report import Point
from tests.paths import a_day_later

#: Incremental cells: a save with ``base=`` killed at a random moment ("inc") or at an
#: exact point (`killpoints.SAVE_STOPS`, "inc-at"); a deletion of a step another
#: references ("delete-ref", at a random moment or at `killpoints.DELETE_STOPS`); and a
#: race of three processes: an incremental save, the deletion of its base and a gc with
#: a tiny grace, one of them killed ("race"); a save stopped at an exact point while the
#: deletion of its base and a gc run to their end, then resumed or killed ("pause").
INCREMENTAL_CELLS = [("inc", 1), ("inc", 2), ("inc-at", 1), ("inc-at", 2)]
INCREMENTAL_CELLS += [("delete-ref", 1), ("race", 1), ("pause", 1)]
#: A race's actors (the worker's operations) and the phase each is killed in.
RACE = [("race-save", "save"), ("race-delete", "delete"), ("race-gc", "gc")]


@dataclass
class Store:
    """One backend's checkpoints as the driver knows them."""

    name: str
    url: str  # what workers open: a path or an S3 profile
    backend: Backend
    weight: int = 1  # its cells' copies in each deck
    committed: dict[int, str] = field(default_factory=dict)  # step -> its kind (worker.KINDS)
    stray: set[str] = field(default_factory=set)  # objects gc left, already reported
    next_step: int = 1

    def fresh_step(self) -> int:
        self.next_step += 1
        return self.next_step - 1


def kind_of(op: str, processes: int) -> str:
    """The kind of tree (`worker.KINDS`) operation ``op`` saves."""
    inc = op in ("inc", "inc-at", "race", "pause", "delete-ref")
    return ("inc" if inc else "tree") + ("-sharded" if processes > 1 else "")


class IncrementalOps:
    """The campaign's (`tests.campaigns.torture.Campaign`) incremental half."""

    rng: random.Random
    env: dict[str, str]
    worker_log: str
    zygote: worker.Zygote

    async def check_committed(self, point: Point, store: Store, listed: set[int]) -> None:
        raise NotImplementedError

    def window(self, store: Store, processes: int, phase: str) -> float:
        raise NotImplementedError

    async def base(self, store: Store, kind: str, *, fresh: bool = False) -> int:
        """The newest committed step of ``kind``, saved (in full) first if there is none
        (or ``fresh``); the sharded kind's by two worker processes, whose pieces an
        incremental save of two can then match."""
        mine = [s for s, k in store.committed.items() if k == kind]
        if mine and not fresh:
            return max(mine)
        step = store.fresh_step()
        if kind == "inc":
            await ckptstore.save(
                store.backend, worker.inc_tree(step), step=step, chunk_bytes=worker.CHUNK_BYTES
            )
        else:
            await self.complete(self.jobs(store, "save", step, 2, kind=kind))
        store.committed[step] = kind
        return step

    async def referenced_step(self, store: Store) -> int:
        """A committed step whose attempt another committed step references (saving an
        incremental step first if there is none); if even then there is none, the base
        of the newest incremental step (whose holder's step was deleted already)."""
        found = await manifests(store.backend, store.committed)
        held = {(r.step, r.attempt) for m in found.values() for r in m.references}
        holders = sorted(s for s, m in found.items() if (s, m.attempt) in held)
        if holders:
            return self.rng.choice(holders)
        base = await self.base(store, "inc")
        step = store.fresh_step()
        await ckptstore.save(
            store.backend,
            worker.inc_tree(step),
            step=step,
            base=base,
            chunk_bytes=worker.CHUNK_BYTES,
        )
        store.committed[step] = "inc"
        found = await manifests(store.backend, [base])
        return base if not found[base].references else max(store.committed)

    def jobs(
        self, store: Store, op: str, step: int, processes: int, **extra: Any
    ) -> list[dict[str, Any]]:
        """The workers' jobs for ``op`` on ``step`` by ``processes`` processes."""
        coordinator = f"127.0.0.1:{free_port()}"
        common = {"op": op, "target": store.url, "step": step, "processes": processes}
        common |= {"coordinator": coordinator, "env": self.env, "log": self.worker_log}
        return [{**common, "process": i, **extra} for i in range(processes)]

    def interpose(self, point: Point, store: Store) -> list[tuple[Any, ...]]:
        """While a paused save (S) is stopped at its exact point: the deletion of its base
        (D), then a gc with a tiny grace (G), each run to its end by a worker; their
        events (as processes 1 and 2)."""
        assert point.base is not None
        delete = self.jobs(store, "race-delete", point.base, 1)[0] | {"process": 1}
        gc = self.jobs(store, "race-gc", point.step, 1)[0] | {"process": 2}
        gc["grace"] = point.grace
        events: list[tuple[Any, ...]] = []
        for job in (delete, gc):
            procs, conn = self.zygote.start([job])
            try:
                events += until_done(conn, {job["process"]}, 60.0)
            finally:
                for p in procs:
                    p.join(timeout=30)
                conn.close()
        return events

    def point_jobs(self, point: Point, store: Store) -> list[dict[str, Any]]:
        if point.op not in ("race", "pause"):
            extra = {"kind": point.kind, "base": point.base, "stop": point.stop}
            return self.jobs(store, point.op, point.step, point.processes, **extra)
        if point.op == "pause":  # S alone; D and G come while it is stopped (`interpose`)
            extra = {"kind": point.kind, "base": point.base, "stop": point.stop}
            return self.jobs(store, "race-save", point.step, 1, **extra)
        assert point.base is not None
        save, delete, gc = (self.jobs(store, op, point.step, 1)[0] for op, _ in RACE)
        save |= {"kind": point.kind, "base": point.base}
        # The deletion and gc start a drawn moment into the save (its base read, its
        # digests and agreement, its writes, its merge, its commit: each a different race).
        usual = self.window(store, 1, "save")
        delete |= {"step": point.base, "process": 1, "delay": point.later * usual}
        gc |= {"process": 2, "grace": point.grace}
        gc["delay"] = (point.fraction + point.later) % 1 * usual
        return [save, delete, gc]

    async def complete(self, jobs: list[dict[str, Any]]) -> None:
        """Run ``jobs`` to their end, unkilled: a failure is the campaign's."""
        procs, conn = self.zygote.start(jobs)
        try:
            events = await asyncio.to_thread(until_done, conn, set(range(len(jobs))), 120.0)
        finally:
            for p in procs:
                p.join(timeout=30)
            conn.close()
        errors = [e for e in events if e[1] == "error"]
        if errors or sum(e[1] == "done" for e in events) < len(jobs):
            raise RuntimeError(f"an unkilled {jobs[0]['op']} failed: {errors}")

    async def finish_deletions(self, point: Point, store: Store) -> None:
        """A deletion killed after its ``DELETED`` record left its step listed: finish it,
        as its caller would (such a step no longer serves as a base: docs/incremental.md),
        and check the others again."""
        backend = store.backend
        for s, manifest in (await manifests(backend, sorted(store.committed))).items():
            assert manifest.attempt is not None
            if await backend.exists(layout.AttemptDir(s, manifest.attempt).deleted):
                await ckptstore.delete_step(backend, s)
                del store.committed[s]
                point.finished.append(s)
        if point.finished:
            await self.check_committed(point, store, set(store.committed))

    async def finish(self, store: Store) -> dict[str, Any]:
        """After the campaign: delete every committed step, oldest (the holders) first;
        after each deletion the others still restore, verify and find their references;
        then `gc` (and again a day later) must leave nothing at all."""
        problems: list[str] = []
        deleted = 0
        while store.committed:
            oldest = min(store.committed)
            await ckptstore.delete_step(store.backend, oldest)
            del store.committed[oldest]
            deleted += 1
            point = Point(-1, "finish", store.name, 1, oldest, [], 0, 0.0, 0.0)
            await self.check_committed(point, store, set(store.committed))
            problems += [f"after deleting step {oldest}: {p}" for p in point.problems]
            problems += [f"after deleting step {oldest}, step {s} is torn" for s in point.torn]
        await ckptstore.gc(store.backend, older_than=0)
        with a_day_later():  # twice: see `Campaign.collect`
            await ckptstore.gc(store.backend, older_than=0)
            await ckptstore.gc(store.backend, older_than=0)
        left = sorted(await everything(store.backend) - store.stray)
        if left:
            problems.append(f"gc left {len(left)} objects with no step committed: {left[:5]}")
        return {"deleted": deleted, "left": len(left), "problems": problems}


def until_done(conn: Connection, waiting: set[int], timeout: float) -> list[tuple[Any, ...]]:
    """The events workers send until each of ``waiting`` sent "done" or "error" (or every
    worker is gone, or ``timeout`` s passed)."""
    events: list[tuple[Any, ...]] = []
    waiting = set(waiting)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        if not conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
            continue
        try:
            event = conn.recv()
        except EOFError:
            break
        events.append(event)
        if event[1] in ("done", "error"):
            waiting.discard(event[0])
    return events


def s3_profile(folder: Path, endpoint: str, bucket: str, name: str) -> str:
    profile = folder / f"{name}.toml"
    profile.write_text(
        f'url = "s3://{bucket}/{name}"\n[options]\nendpoint = "{endpoint}"\ncredentials = "env"\n'
    )
    return str(profile)


def moto_env(folder: Path) -> dict[str, str]:
    """What the workers and the driver need to reach moto (the pytest plugin's settings)."""
    empty = folder / "aws-empty"
    empty.write_text("")
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(empty),
        "AWS_SHARED_CREDENTIALS_FILE": str(empty),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
