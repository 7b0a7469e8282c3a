"""Commit protocol v3 with real OS processes: two processes act on one attempt (or one
step) at the same moment, round after round, on local disk and on moto's S3. No committed
step may be lost or torn and no error may be untyped (tests/campaigns/fate_race_worker.py).

`make races` runs 50 rounds of every shape on each backend (``CKPTSTORE_RACE_ROUNDS``).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from tests.campaigns.fate_race_worker import SHAPES, fast_dir, parts_tree, run, tree
from tests.checkpoint.test_partial import shared_target

ROUNDS = {"local": 4, "s3": 2}


def rounds(kind: str) -> int:
    return int(os.environ.get("CKPTSTORE_RACE_ROUNDS") or ROUNDS[kind])


def same(a: Any, b: Any) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def restores_to(target: Any, step: int, wanted: list[dict[str, Any]]) -> str | None:
    """None if ``step`` restores to one of ``wanted`` and verifies; else what is wrong."""
    try:
        got = ckptstore.restore_sync(target, step=step)
    except ckptstore.CkptStoreError as exc:
        return f"step {step} does not restore: {exc!r}"
    if not any(same(got, w) for w in wanted):
        return f"step {step} restores to a tree no winner saved"
    if not ckptstore.verify_sync(target, step=step).ok:
        return f"step {step} fails verify"
    return None


def judge(target: str, workdir: Path, shape: str, step: int, outcome: dict[int, str]) -> list[str]:
    """What went wrong in one round, from what each actor was told and what is stored."""
    problems = [f"role {r}: {o}" for r, o in outcome.items() if o.startswith("untyped")]
    ok = {r for r, o in outcome.items() if o == "ok"}
    listed = step in ckptstore.list_steps_sync(target)
    if shape == "finalize-finalize":
        if len(ok) != 1:
            problems.append(f"{len(ok)} finalizes of one session reported success")
    if shape in ("finalize-finalize", "gc-idle-finalize") or (
        shape == "abandon-finalize" and 1 in ok
    ):
        finalized = ok if shape != "gc-idle-finalize" else ok & {1}
        if finalized and not listed:
            problems.append("a finalize reported success; the step is not listed")
    if shape == "abandon-finalize" and ok == {0, 1}:
        problems.append("both the abandon and the finalize reported success")
    if shape == "abandon-finalize" and ok == {0} and listed:
        problems.append("the abandon reported success; the step is committed")
    if shape in ("gc-save", "two-managers"):
        savers = ok if shape == "two-managers" else ok & {1}
        if savers and not listed:
            problems.append(f"saves by {sorted(savers)} reported success; step not listed")
    if shape == "delete-promote":
        tiers = ckptstore.Tiered(fast_dir(str(workdir)), target)
        if 1 in ok and step in ckptstore.list_steps_sync(tiers):
            problems.append("delete_step reported success; the step is listed again")
        return problems
    if listed:
        if shape in ("gc-save", "two-managers"):
            wanted = [tree(r, step) for r in (ok or {0, 1})]
        else:
            wanted = [parts_tree()]
        why = restores_to(target, step, wanted)
        if why:
            problems.append(why)
    return problems


def race(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, list[str]]:
    # A root per shape: each gc scans only its own shape's steps.
    targets = {shape: shared_target(kind, request, tmp_path, f"races-{shape}") for shape in SHAPES}
    workdir = tmp_path / "work"
    workdir.mkdir()
    n = rounds(kind)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    args = (list(SHAPES), targets, str(workdir), n, barrier, results)
    procs = [ctx.Process(target=run, args=(role, *args)) for role in (0, 1)]
    for p in procs:
        p.start()
    outcomes: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    try:
        for _ in range(2 * n * len(SHAPES)):
            shape, step, role, outcome = results.get(timeout=600)
            outcomes[(shape, step)][role] = outcome
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    # Judged once every round is over: later rounds' gc must not have harmed earlier steps.
    found: dict[str, list[str]] = defaultdict(list)
    for (shape, step), outcome in sorted(outcomes.items()):
        for problem in judge(targets[shape], workdir, shape, step, outcome):
            found[shape].append(f"step {step} {outcome}: {problem}")
    return found


@pytest.mark.parametrize("kind", list(ROUNDS))
def test_two_processes_on_one_attempt_lose_nothing(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    found = race(kind, request, tmp_path)
    assert not found, "\n".join(p for problems in found.values() for p in problems)
