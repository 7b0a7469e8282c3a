"""Commit protocol v3 with real OS processes: two processes act on one attempt (or one
step) at the same moment, round after round, on local disk and on moto's S3. No committed
step may be lost or torn and no error may be untyped (tests/campaigns/fate_race_worker.py).

`make races` runs 50 rounds of every shape on each backend (``CKPTSTORE_RACE_ROUNDS``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from tests.campaigns.fate_race_worker import LATER, SHAPES, fast_dir, parts_tree, run, tree
from tests.checkpoint.helpers import shared_target

ROUNDS = {"local": 4, "s3": 1}  # `make races`: 50 each (CKPTSTORE_RACE_ROUNDS)


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
    if shape in ("delete-resave", "keep-rm", "replace-base"):
        return problems + judge_v3_closed(target, workdir, shape, step, outcome)
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


def judge_v3_closed(
    target: str, workdir: Path, shape: str, step: int, outcome: dict[int, str]
) -> list[str]:
    """The shapes of protocol v3's closing issue: a stale deletion, a keep policy racing
    `rm`, a base replaced under an incremental manager."""
    problems = []
    listed = ckptstore.list_steps_sync(target)
    if shape == "delete-resave" and outcome[1] == "ok":
        saved = json.loads((workdir / f"{shape}-{step}-1.json").read_text())["attempt"]
        deleter = workdir / f"{shape}-{step}-0.json"
        removed = json.loads(deleter.read_text())["removed"] if deleter.exists() else []
        if step in listed:
            problems += [why for why in [restores_to(target, step, [tree(1, step)])] if why]
        elif not any(entry.endswith(saved) for entry in removed):
            problems.append("the re-saved step is gone, and no deletion read its marker")
    if shape == "keep-rm":
        if outcome[0] != "ok":
            problems.append("the manager's keep policy failed although its goal held")
        if step in listed:
            problems.append("the step both deleted is listed")
    if shape == "replace-base" and step + LATER in listed:
        why = restores_to(target, step + LATER, [tree(0, step)])
        if why:
            problems.append(f"the manager's later step: {why}")
    return problems


def shapes() -> list[str]:
    """Every shape, or those ``CKPTSTORE_RACE_SHAPES`` names (comma-separated)."""
    chosen = os.environ.get("CKPTSTORE_RACE_SHAPES")
    return [s for s in SHAPES if not chosen or s in chosen.split(",")]


def race(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, list[str]]:
    # A root per shape: each gc scans only its own shape's steps.
    targets = {s: shared_target(kind, request, tmp_path, f"races-{s}") for s in shapes()}
    workdir = tmp_path / "work"
    workdir.mkdir()
    n = rounds(kind)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    args = (list(targets), targets, str(workdir), n, barrier, results)
    procs = [ctx.Process(target=run, args=(role, *args)) for role in (0, 1)]
    for p in procs:
        p.start()
    outcomes: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    try:
        for _ in range(2 * n * len(targets)):
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
@pytest.mark.slow
def test_two_processes_on_one_attempt_lose_nothing(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    found = race(kind, request, tmp_path)
    assert not found, "\n".join(p for problems in found.values() for p in problems)
