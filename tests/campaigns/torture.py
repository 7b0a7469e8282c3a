"""SIGKILL torture: kill real processes at random moments of every write path, then check.

Each kill point runs one operation in freshly forked worker processes
(`tests.campaigns.torture_worker`): a save (whole, or aimed at its merge or its commit), a
partial save's ``add`` or ``finalize``, ``delete_step`` or ``gc``, on local disk or on
moto's S3 server, by one process or by two joined with ``jax.distributed``. When the
aimed phase starts, the driver waits a random fraction of that phase's usual duration
and SIGKILLs the worker (of two, one or both; the rest die a random moment later, as a
job's surviving processes would be killed by the scheduler). Then, in the driver:

- only committed steps are listed: the steps committed before, give or take the step
  the killed operation was saving (or deleting);
- every listed step restores bit-exact (a step missing or restoring wrong is *lost* or
  *torn*);
- the killed step can be saved again (a killed partial save is resumed and finalized);
- ``gc`` removes every leftover and nothing committed.

The incremental operations (`INCREMENTAL_CELLS`) save with ``base=`` a tree whose frozen
leaves are unchanged since the base, kill a deletion of a step others reference, race
an incremental save against the deletion of its base and a ``gc`` with a tiny grace
period, and stop a save at an exact point while those two run (then resume or kill it).
After every point every committed step also passes ``verify``, and every reference finds
its holder's bytes (a deleted base's included); ``gc`` must free a holder once nothing
references it, and at the end every step is deleted and ``gc`` must leave nothing.

The kill points come from one seeded random generator (printed): the same seed gives the
same operations, processes, victims and fractions; where in the code a kill lands still
depends on timing, so each point records the phase it landed in. Usage::

    python -m tests.campaigns.torture [--points 300] [--seed N]
        [--json benchmarks/results/torture.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckptstore
from tests.campaigns import torture_worker as worker
from tests.campaigns.killpoints import DELETE_STOPS, SAVE_STOPS
from tests.campaigns.torture_incremental import (
    INCREMENTAL_CELLS,
    RACE,
    IncrementalOps,
    Store,
    kind_of,
    moto_env,
    s3_profile,
    until_done,
)
from tests.campaigns.torture_refs import check_references, committed_keys, everything
from tests.campaigns.torture_report import RESULTS, Point, summary, table, write
from tests.paths import a_day_later

#: A paused save stopped at one of these (before its manifest) is always resumed.
PAUSE_RESUMED = SAVE_STOPS[: SAVE_STOPS.index("manifest")]
#: (operation, processes) cells; each runs on every backend.
CELLS = [
    ("save", 1),
    ("merge", 1),
    ("commit", 1),
    ("add", 1),
    ("finalize", 1),
    ("delete", 1),
    ("gc", 1),
    ("save", 2),
    ("add", 2),
    ("finalize", 2),
]
#: The phase each operation aims its kill at ("stop": the exact point the worker stops at).
AIM = {"save": "save", "merge": "merge", "commit": "commit", "add": "add", "inc": "save"}
AIM |= {"finalize": "finalize", "delete": "delete", "gc": "gc", "delete-ref": "delete"}
AIM |= {"inc-at": "stop", "pause": "stop"}
#: First guesses of phase durations (s), replaced by what the campaign observes.
GUESS = {"save": 0.4, "merge": 0.05, "commit": 0.02, "add": 0.15}
GUESS |= {"finalize": 0.1, "delete": 0.03, "gc": 0.1}


class Campaign(IncrementalOps):
    def __init__(
        self,
        stores: list[Store],
        seed: int,
        env: dict[str, str],
        keep: int,
        worker_log: str,
        cells: list[tuple[str, int]],
    ) -> None:
        self.cells = cells
        self.stores = stores
        self.keep = keep  # committed steps kept per backend (older ones deleted between points)
        self.worker_log = worker_log
        self.seed = seed
        self.rng = random.Random(seed)
        self.env = env
        self.zygote = worker.Zygote()
        self.durations: dict[tuple[str, int, str], list[float]] = defaultdict(list)
        self.bounds: dict[tuple[str, int, str], list[float]] = defaultdict(list)  # killed at
        self.points: list[Point] = []
        self.deck: list[tuple[tuple[str, int], Store]] = []
        self.stops: list[str] = []  # the paused saves' exact points: each once per len(SAVE_STOPS)

    # ---- planning ----

    def plan(self, index: int) -> tuple[Point, Store]:
        """The next kill point: cells come from a shuffled deck of every (operation,
        processes, backend), each backend ``weight`` times, so every one is hit before any
        is hit again."""
        if not self.deck:
            self.deck = [(c, s) for c in self.cells for s in self.stores for _ in range(s.weight)]
            self.rng.shuffle(self.deck)
        (op, processes), store = self.deck.pop()
        victims = [0] if processes == 1 else self.rng.choice([[0], [1], [0, 1]])
        stop = ""
        if op == "inc-at":  # the stopped process (0) dies with it
            stop, victims = self.rng.choice(SAVE_STOPS), [0] if processes == 1 else [0, 1]
        elif op == "pause":
            if not self.stops:
                self.stops = self.rng.sample(SAVE_STOPS, len(SAVE_STOPS))
            stop = self.stops.pop()
        elif op == "delete-ref":
            stop = self.rng.choice(["", *DELETE_STOPS])
        elif op == "race":
            victims = [self.rng.randrange(len(RACE))]
        point = Point(
            index=index,
            op=op,
            backend=store.name,
            processes=processes,
            step=-1,
            victims=victims,
            occurrence=self.rng.randrange(len(worker.expected(0, kind_of(op, processes))))
            if op == "add"
            else 0,
            fraction=self.rng.random(),
            later=self.rng.random(),
            kind=kind_of(op, processes),
            stop=stop,
            grace=round(0.5 * self.rng.random() ** 2, 3) if op in ("race", "pause") else 0.0,
        )
        if stop:
            point.fraction = 0.0
        return point, store

    def aim(self, point: Point) -> tuple[int, str]:
        """The process whose phase starts the kill's clock, and that phase."""
        if point.op == "race":
            return point.victims[0], RACE[point.victims[0]][1]
        return 0, "stop" if point.stop else AIM[point.op]

    def window(self, store: Store, processes: int, phase: str) -> float:
        """The span a kill is drawn from: a quarter more than the phase usually lasts (so
        some kills come after it, and its length keeps being measured)."""
        key = (store.name, processes, phase)
        seen = self.durations.get(key, [])[-5:]
        usual = statistics.median(seen) if seen else GUESS[phase]
        bound = max(self.bounds.get(key, [])[-5:], default=0.0)
        if bound > usual:  # killed later than it usually ends: it takes longer here
            usual = 1.5 * bound
        return 1.25 * usual

    # ---- one kill point ----

    async def run_point(self, index: int) -> Point:
        start = time.monotonic()
        point, store = self.plan(index)
        await self.prepare(point, store)
        t0 = time.monotonic()
        events, t_kill = self.kill(point, store)
        t1 = time.monotonic()
        point.landed = self.landed(events, point, t_kill)
        self.learn(store, point, events, t_kill)
        await self.check(point, store)
        point.seconds = time.monotonic() - start
        point.timing = [round(t0 - start, 2), round(t1 - t0, 2), round(time.monotonic() - t1, 2)]
        self.points.append(point)
        return point

    async def prepare(self, point: Point, store: Store) -> None:
        if point.op == "delete":
            if not store.committed:
                step = store.fresh_step()
                await ckptstore.save(store.backend, worker.tree(step), step=step)
                store.committed[step] = "tree"
            point.step = self.rng.choice(sorted(store.committed))
        elif point.op == "delete-ref":
            point.step = await self.referenced_step(store)
        elif point.op == "gc":  # garbage: a partial save left unfinished
            step = store.fresh_step()
            session = await ckptstore.partial_save(store.backend, step)
            for k in range(2):
                await session.add({str(k): worker.tree(step)[str(k)]})
            point.step = step
        else:
            if point.op in ("inc", "inc-at", "race", "pause"):
                # A paused save's base, and half the races', holds the bytes itself (a full
                # save): then nothing else keeps them, and only the protocol decides.
                fresh = point.op == "pause" or (point.op == "race" and self.rng.random() < 0.5)
                point.base = await self.base(store, point.kind, fresh=fresh)
            point.step = store.fresh_step()

    def kill(self, point: Point, store: Store) -> tuple[list[tuple[Any, ...]], float | None]:
        """Run the operation and SIGKILL it as planned; the events the workers sent, and
        when the kill came (None: the operation ended first)."""
        jobs = self.point_jobs(point, store)
        aim_proc, aim = self.aim(point)
        point.window = self.window(store, point.processes, "save" if aim == "stop" else aim)
        procs, conn = self.zygote.start(jobs)
        events: list[tuple[Any, ...]] = []
        deadline: float | None = None
        t_kill: float | None = None
        give_up = time.monotonic() + 120
        try:
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    t_kill = time.monotonic()
                    for i in point.victims:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(procs[i].pid, signal.SIGKILL)
                    break
                wait = 0.05 if deadline is None else max(0.0, deadline - now)
                if conn.poll(wait):
                    try:
                        event = conn.recv()
                    except EOFError:  # every worker is gone (crashed: see problems)
                        break
                    events.append(event)
                    proc, phase, edge, at, n = event
                    aimed = (proc, phase, edge, n) == (aim_proc, aim, "start", point.occurrence)
                    if aimed and deadline is None and point.op == "pause":
                        events += self.interpose(point, store)  # S stopped: D, then G
                        # Resumed if stopped before its manifest (inc-at kills it there),
                        # else resumed or killed.
                        resume = point.stop in PAUSE_RESUMED or point.later >= 0.5
                        deadline = time.monotonic() + 120 if resume else at
                        if resume:
                            point.resumed = True
                            os.kill(procs[0].pid, signal.SIGCONT)
                    elif aimed and deadline is None:
                        deadline = at + point.fraction * point.window
                    elif phase == "error" and point.op != "race":
                        break
                finished = {e[0] for e in events if e[1] in ("done", "error")}
                if len(finished) == len(jobs) or now > give_up:
                    break
            if t_kill is not None and point.processes > 1:  # the rest, a moment later
                time.sleep(point.later * point.window)
            if t_kill is not None and point.op == "race":  # the other actors run to their end
                done = {e[0] for e in events if e[1] in ("done", "error")}
                waiting = set(range(len(jobs))) - set(point.victims) - done
                events += until_done(conn, waiting, give_up - time.monotonic())
        finally:
            for p in procs:
                if p.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(timeout=30)
            while conn.poll(0):
                try:
                    events.append(conn.recv())
                except EOFError:
                    break
            conn.close()
        for proc, phase, text, at, typed in events:
            if phase != "error":
                continue
            if point.op in ("race", "pause") and typed:  # typed outcomes (base gone, fenced)
                point.survivors.append(f"{RACE[proc][0]}: {text.splitlines()[0]}")
            elif t_kill is not None and at > t_kill and typed and proc not in point.victims:
                point.survivors.append(f"process {proc}: {text.splitlines()[0]}")
            else:
                point.problems.append(f"process {proc} raised: {text}")
        if deadline is None and not point.problems:
            point.problems.append(f"the aimed phase ({aim} {point.occurrence}) never started")
        return events, t_kill

    @staticmethod
    def landed(events: list[tuple[Any, ...]], point: Point, t_kill: float | None) -> str:
        """The innermost phase a victim was in when killed ("write": a save's, outside its
        merge and commit); "after" if the operation had ended."""
        if point.resumed:
            return f"at {point.stop}, resumed"
        if t_kill is None:  # the operation ended (or failed) before the kill was due
            return "after"
        if point.stop:
            return f"at {point.stop}"
        open_phases: list[tuple[float, str]] = []
        for victim in point.victims:
            mine = [e for e in events if e[0] == victim and e[3] <= t_kill]
            started: dict[tuple[str, int], float] = {}
            for _, phase, edge, at, n in mine:
                if edge == "start":
                    started[(phase, n)] = at
                elif (phase, n) in started:
                    del started[(phase, n)]
            open_phases += [(at, phase) for (phase, _), at in started.items()]
        if not open_phases:
            return "after"
        phase = max(open_phases)[1]
        phase = "write" if phase == "save" else phase
        if point.op == "race":  # which actor: S, D or G
            return f"{RACE[point.victims[0]][0][5].upper()}:{phase}"
        return phase

    def learn(
        self, store: Store, point: Point, events: list[tuple[Any, ...]], t_kill: float | None
    ) -> None:
        """Remember how long each phase that ended took (process 0's view), and how long
        the aimed phase had run when it was killed."""
        started: dict[tuple[int, str, int], float] = {}
        for proc, phase, edge, at, n in events:
            if proc != 0 and point.op != "race":  # a race's actors are one process each
                continue
            if edge == "start":
                started[(proc, phase, n)] = at
            elif (proc, phase, n) in started:
                key = (store.name, point.processes, phase)
                self.durations[key].append(at - started.pop((proc, phase, n)))
        aim_proc, aim = self.aim(point)
        for (proc, phase, _), at in started.items():
            if (proc, phase) == (aim_proc, aim) and t_kill is not None and aim != "stop":
                self.bounds[(store.name, point.processes, phase)].append(t_kill - at)

    # ---- the checks ----

    async def check(self, point: Point, store: Store) -> None:
        backend, step = store.backend, point.step
        listed = set(await ckptstore.list_steps(backend))
        before = dict(store.committed)
        maybe = {step} if point.op != "gc" else set()
        if point.op in ("race", "pause"):  # its base may be gone, or not
            assert point.base is not None
            maybe.add(point.base)
            if point.base not in listed:
                del store.committed[point.base]
        point.committed = step in listed
        if point.op in ("delete", "delete-ref") and not point.committed:
            del store.committed[step]
        elif point.op not in ("delete", "delete-ref", "gc") and point.committed:
            store.committed[step] = point.kind
        point.lost = sorted(set(before) - listed - maybe)
        extra = sorted(listed - set(before) - maybe)
        if extra:
            point.problems.append(f"steps listed that were never committed: {extra}")
        await self.check_committed(point, store, listed)
        await self.finish_deletions(point, store)
        # The killed step can be saved again (a partial save resumes where it was killed).
        gone = step not in store.committed and step not in point.lost + point.torn
        if point.op != "gc" and gone:
            kind = before[step] if point.op in ("delete", "delete-ref") else point.kind
            await self.save_again(point, store, kind)
        await self.collect(point, store)
        for group in (("tree", "sharded"), ("inc",), ("inc-sharded",)):
            mine = sorted(s for s, k in store.committed.items() if k in group)
            for oldest in mine[: max(0, len(mine) - self.keep)]:  # a holder's bytes stay
                await ckptstore.delete_step(backend, oldest)
                del store.committed[oldest]

    async def check_committed(self, point: Point, store: Store, listed: set[int]) -> None:
        """Every listed committed step restores bit-exact (else it is torn) and passes
        `verify`, and every reference finds its holder's bytes."""
        mine = sorted(s for s in listed if s in store.committed)
        exact = await asyncio.gather(*(self.restores(store, s) for s in mine))
        point.torn += [s for s, ok in zip(mine, exact, strict=True) if not ok]
        for s in mine:
            report = await ckptstore.verify(store.backend, step=s)
            if not report.ok:
                point.problems.append(f"step {s} fails verify: {report.problems}")
        problems, held = await check_references(store.backend, mine)
        point.problems += problems
        point.held = max(point.held, len(held))
        for s in point.lost + point.torn:
            store.committed.pop(s, None)

    async def restores(self, store: Store, step: int) -> bool:
        try:
            restored = await ckptstore.restore(store.backend, step=step)
        except ckptstore.CkptStoreError:
            return False
        return worker.same(restored, worker.expected(step, store.committed[step]))

    async def save_again(self, point: Point, store: Store, kind: str) -> None:
        """Save the killed step again: a partial save resumed, an incremental kind on the
        newest committed step of its kind (if any), any other in full."""
        backend, step = store.backend, point.step
        value = worker.expected(step, kind)
        base = max((s for s, k in store.committed.items() if k == kind), default=None)
        try:
            if point.op in ("add", "finalize"):
                session = await ckptstore.partial_save(backend, step)
                for name in list(value)[len(session.parts) :]:
                    await session.add({name: value[name]})
                await session.finalize()
            elif kind == "inc-sharded":  # by two workers: a base later saves of two match
                await self.complete(self.jobs(store, "inc", step, 2, kind=kind, base=base))
            else:
                inc = kind.startswith("inc")
                chunks = worker.CHUNK_BYTES if inc else None
                base = base if inc else None
                await ckptstore.save(backend, value, step=step, base=base, chunk_bytes=chunks)
        except (ckptstore.CkptStoreError, RuntimeError) as exc:
            point.problems.append(f"saving step {step} again failed: {exc!r}")
            return
        store.committed[step] = kind
        if not await self.restores(store, step):
            point.problems.append(f"step {step}, saved again, does not restore bit-exact")

    async def collect(self, point: Point, store: Store) -> None:
        """gc removes every leftover and nothing a committed step uses: afterwards only the
        committed steps' objects are left, less the unused parts gc said it removed."""
        backend = store.backend
        kept = await committed_keys(backend, await everything(backend))
        removed = (await ckptstore.gc(backend, older_than=0)).entries
        with a_day_later():  # a commit claimed and killed before its marker, tombstones
            removed += (await ckptstore.gc(backend, older_than=0)).entries
            # A base deleted while a killed save's manifest referenced it: kept until that
            # claim expired (the pass above), its data collected then, its records now.
            removed += (await ckptstore.gc(backend, older_than=0)).entries
        unused = {k for k in kept if any(k == e or k.startswith(e + "/") for e in removed)}
        left = await everything(backend)
        if await committed_keys(backend, left) != kept - unused:
            point.problems.append("gc removed objects of a committed step it did not announce")
        stray = sorted(left - (kept - unused) - store.stray)
        if stray:  # reported once (an earlier point's may still be there)
            point.problems.append(f"objects no committed step uses survived gc: {stray[:5]}")
            store.stray |= set(stray)
        if point.op in ("add", "finalize"):  # an unused part may sit in a committed attempt
            again = await ckptstore.gc(backend, older_than=0, dry_run=True)
            if again.entries:
                point.problems.append(f"gc left garbage: {again.entries}")
        if point.step in store.committed and not await self.restores(store, point.step):
            point.problems.append(f"step {point.step} does not restore after gc")

    # ---- the whole campaign ----

    async def run(self, points: int, log: Callable[[str], None]) -> None:
        index = 0
        while sum(p.in_op for p in self.points) < points:
            if index >= 3 * points:
                raise RuntimeError(f"only {self.landed_count()} of {index} kills landed")
            p = await self.run_point(index)
            index += 1
            flags = "" if not (p.lost or p.torn or p.problems) else f" PROBLEM {p.problems}"
            base = f" base {p.base}" if p.base is not None else ""
            log(
                f"[{self.landed_count():4d}/{points}] {p.backend:5} {p.op:10} x{p.processes} "
                f"step {p.step:3d}{base} kill {p.victims} at {p.fraction:.2f} of "
                f"{p.window * 1e3:.0f} ms "
                f"-> {p.landed:8} committed={p.committed} lost={p.lost} torn={p.torn} "
                f"{p.timing}{flags}"
            )

    def landed_count(self) -> int:
        return sum(p.in_op for p in self.points)


async def torture(
    targets: dict[str, str],
    *,
    points: int,
    seed: int,
    env: dict[str, str],
    log: Callable[[str], None],
    worker_log: Path,
    keep: int = 3,
    weights: dict[str, int] | None = None,
    cells: list[tuple[str, int]] | None = None,
) -> tuple[dict[str, Any], list[Point]]:
    """Run a campaign of ``points`` kills on ``targets`` (name -> path or profile); the
    workers' stderr goes to ``worker_log``. ``env`` reaches the workers (the driver's
    own environment is the caller's business). ``weights`` (default 1) repeats a backend's
    cells in the deck; ``cells`` (default: `CELLS` and `INCREMENTAL_CELLS`) are the
    (operation, processes) pairs killed. The report's "final" says, per backend, what
    deleting every step and collecting left (`Campaign.finish`)."""
    start = time.monotonic()
    backends = {
        name: ckptstore.open_backend(profile=url)
        if url.endswith(".toml")
        else ckptstore.open_backend(url)
        for name, url in targets.items()
    }
    weight = weights or {}
    stores = [Store(name, targets[name], b, weight.get(name, 1)) for name, b in backends.items()]
    chosen = cells if cells is not None else CELLS + INCREMENTAL_CELLS
    campaign = Campaign(stores, seed, env, keep, str(worker_log), chosen)
    log(f"torture: seed {seed}, {points} kill points on {', '.join(targets)}")
    final: dict[str, Any] = {}
    try:
        await campaign.run(points, log)
        for store in stores:
            final[store.name] = await campaign.finish(store)
    finally:
        campaign.zygote.stop()
        for b in backends.values():
            await b.close()
    report = summary(campaign.points)
    report["seed"] = seed
    report["final"] = final
    report["seconds"] = round(time.monotonic() - start, 1)
    report["windows_ms"] = {
        f"{b} x{n} {phase}": round(statistics.median(v) * 1e3, 1)
        for (b, n, phase), v in sorted(campaign.durations.items())
    }
    return report, campaign.points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=300, help="kills that land in an operation")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    parser.add_argument("--keep", type=int, default=3, help="committed steps kept per kind")
    parser.add_argument(
        "--cells", default="all", choices=["all", "plain", "incremental"], help="operations"
    )
    parser.add_argument("--json", default=str(RESULTS), help="where to write results ('': nowhere)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    command = f"python -m tests.campaigns.torture --points {args.points} --seed {seed}"
    if args.backends != "local,s3" or args.keep != 3:
        command += f" --backends {args.backends} --keep {args.keep}"
    if args.cells != "all":
        command += f" --cells {args.cells}"
    cells = {"plain": CELLS, "incremental": INCREMENTAL_CELLS}.get(args.cells)
    from ckptstore.testing.servers import MotoS3Server

    with tempfile.TemporaryDirectory(prefix="torture-") as tmp, MotoS3Server() as moto:
        folder = Path(tmp)
        targets: dict[str, str] = {}
        names = args.backends.split(",")
        if "local" in names:
            targets["local"] = str(folder / "local")
        if "s3" in names:
            targets["s3"] = s3_profile(folder, moto.endpoint, moto.create_bucket(), "torture")
        env = moto_env(folder)
        os.environ.update(env)
        worker_log = folder / "workers.log"
        report, points = asyncio.run(
            torture(
                targets,
                points=args.points,
                seed=seed,
                env=env,
                log=print,
                worker_log=worker_log,
                keep=args.keep,
                cells=cells,
            )
        )
        failed = any(p.lost or p.torn or p.problems for p in points)
        failed |= any(f["problems"] for f in report["final"].values())
        if failed and worker_log.exists():
            print("the workers' stderr (last 3000 characters):")
            print(worker_log.read_text(errors="replace")[-3000:])
    print(table(report))
    print(f"seed {seed}; {report['seconds']} s; rerun: {command}")
    if args.json:
        write(Path(args.json), report, points, command=command, commit=_commit())
    return 1 if failed else 0


def _commit() -> str:
    """The checked-out commit, for the results file ("" outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent
        )
    except OSError:
        return ""
    return out.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
