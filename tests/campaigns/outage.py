"""A tiered training loop through an outage of its durable tier (`make outage`).

A `CheckpointManager(Tiered(local disk, moto S3 behind a FaultProxy))` saves every
``--every`` seconds of a loop of small steps, keeping 4 steps. After ``--before`` seconds the
durable tier goes away (``--fault``: 503s to everything, dropped connections, or a black
hole) for ``--outage`` seconds, then comes back; the loop runs ``--after`` more seconds.
Recorded: every save's call-to-committed time, the steps committed on the fast tier during
the outage, when the durable tier had caught up (every step on the fast tier also durable)
after it came back, and at the end that every step on the durable tier restores bit-exact
from it alone. Exit 1 if a save failed or took over ``--bound`` seconds, a step is missing
from the durable tier once caught up, or a restore differs. Results as JSON (``--out``).

`python -m tests.campaigns.outage --outage 60` is the issue's run (~2.5 min);
``--outage 5 --before 3 --after 5`` a quick one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ckptstore
from ckptstore.backends.s3 import S3Backend
from ckptstore.runtime.blocking import run as blocking_run
from ckptstore.testing.faultproxy import Fault, FaultProxy
from ckptstore.testing.servers import MotoS3Server
from tests.tiers.helpers import impatient_s3


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((256, 256)).astype(np.float32), "step": np.int64(step)}


def durable_s3(bucket: str, endpoint: str) -> S3Backend:
    """The durable tier as a job would configure it, with timeouts short enough that a
    black hole is noticed within seconds."""
    return impatient_s3(
        bucket,
        endpoint,
        attempts=3,
        base_delay=0.05,
        max_delay=0.5,
        connect_timeout=1.0,
        read_timeout=2.0,
    )


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    saves: list[dict[str, Any]] = []
    with MotoS3Server() as server, FaultProxy(server.endpoint) as proxy:
        bucket = server.create_bucket()
        tiered = ckptstore.Tiered(
            fast=str(root / "nvme"), durable=durable_s3(bucket, proxy.endpoint)
        )
        keep = ckptstore.policies.KeepLatest(4)
        options = ckptstore.ManagerOptions(handle_sigterm=False)
        mgr = ckptstore.CheckpointManager(tiered, keep_policy=keep, options=options)
        start = time.monotonic()
        phases = [("before", args.before), ("outage", args.outage), ("after", args.after)]
        step, caught_up_after, during = 0, None, set()
        try:
            for phase, seconds in phases:
                if phase == "outage":
                    proxy.set_faults(Fault(args.fault, rate=1.0))
                elif phase == "after":
                    proxy.set_faults()
                    back = time.monotonic()
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    step += 1
                    began = time.monotonic()
                    stats = mgr.save(step, state(step), force=True).wait()  # type: ignore[union-attr]
                    saves.append(
                        {
                            "step": step,
                            "phase": phase,
                            "at": round(began - start, 2),
                            "seconds": round(time.monotonic() - began, 3),
                            "unpromoted": len(stats.unpromoted),
                        }
                    )
                    if phase == "outage":
                        during.add(step)
                    if phase == "after" and caught_up_after is None and _caught_up(mgr, during):
                        caught_up_after = round(time.monotonic() - back, 2)
                    time.sleep(args.every)
            mgr.wait_until_finished()
            if caught_up_after is None and _caught_up(mgr, during):
                caught_up_after = round(time.monotonic() - back, 2)
        finally:
            proxy.set_faults()
            mgr.close()
        direct = S3Backend(bucket, "run", endpoint_url=server.endpoint, credentials="env")
        durable_steps = ckptstore.list_steps_sync(direct)
        fast_steps = ckptstore.list_steps_sync(str(root / "nvme"))
        wrong = [
            s
            for s in durable_steps
            if not np.array_equal(ckptstore.restore_sync(direct, s)["w"], state(s)["w"])
        ]
        injected = dict(proxy.injected)
        for backend in (direct, tiered.durable):
            blocking_run(backend.close())  # type: ignore[union-attr]
    return _report(args, saves, caught_up_after, durable_steps, fast_steps, wrong, injected)


def _caught_up(mgr: ckptstore.CheckpointManager, during: set[int]) -> bool:
    """Whether nothing waits for the durable tier and every step saved during the outage
    that the fast tier still keeps is durable (the newest step's own promotion, running
    after its save, is not what the outage left behind)."""
    if mgr.unpromoted:
        return False
    assert isinstance(mgr.backend, ckptstore.Backend) and mgr.durable is not None
    kept = set(ckptstore.list_steps_sync(mgr.backend)) & during
    return kept <= set(ckptstore.list_steps_sync(mgr.durable))


def _report(
    args: argparse.Namespace,
    saves: list[dict[str, Any]],
    caught_up_after: float | None,
    durable_steps: list[int],
    fast_steps: list[int],
    wrong: list[int],
    injected: dict[str, int],
) -> dict[str, Any]:
    during = [s for s in saves if s["phase"] == "outage"]
    times = [s["seconds"] for s in saves]
    problems = []
    if not during:
        problems.append("no save committed during the outage")
    if max(times, default=0.0) > args.bound:
        problems.append(f"a save took {max(times)} s, over the bound of {args.bound} s")
    if caught_up_after is None:
        problems.append("the durable tier never caught up")
    if not set(fast_steps) <= set(durable_steps):
        problems.append(f"fast-tier steps {fast_steps} not all durable {durable_steps}")
    if wrong:
        problems.append(f"durable steps {wrong} restore other values")
    return {
        "fault": args.fault,
        "outage_seconds": args.outage,
        "saves": len(saves),
        "saves_during_outage": len(during),
        "save_seconds_median": statistics.median(times) if times else None,
        "save_seconds_max": max(times, default=None),
        "save_seconds_max_during_outage": max((s["seconds"] for s in during), default=None),
        "most_unpromoted": max((s["unpromoted"] for s in saves), default=0),
        "caught_up_seconds_after_outage": caught_up_after,
        "durable_steps": durable_steps,
        "fast_steps": fast_steps,
        "faults_injected": injected,
        "problems": problems,
        "timeline": saves,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--outage", type=float, default=60.0, help="seconds the durable tier is down"
    )
    parser.add_argument("--before", type=float, default=10.0)
    parser.add_argument("--after", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between saves")
    parser.add_argument("--fault", choices=["status", "drop", "blackhole"], default="drop")
    parser.add_argument("--bound", type=float, default=15.0, help="seconds a save may take")
    parser.add_argument("--out", default="", help="write the result as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto takes any
        os.environ.setdefault(name, "testing")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    summary = {k: v for k, v in result.items() if k != "timeline"}
    print(json.dumps(summary, indent=1))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
