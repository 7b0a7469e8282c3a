"""N real OS processes save the same step at the same moment: exactly one commits each round."""

from __future__ import annotations

import multiprocessing
from collections import defaultdict
from pathlib import Path

import pytest

import ckptstore
from tests.campaigns.race_worker import run, tree
from tests.checkpoint.helpers import shared_target

WRITERS = 4
ROUNDS = {"local": 20, "s3": 10}


@pytest.mark.parametrize("kind", list(ROUNDS))
@pytest.mark.slow
def test_racing_processes_one_winner_per_round(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    target = shared_target(kind, request, tmp_path, "race")
    rounds = ROUNDS[kind]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [
        ctx.Process(target=run, args=(target, w, rounds, barrier, results)) for w in range(WRITERS)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, dict[int, str]] = defaultdict(dict)
    for _ in range(WRITERS * rounds):
        step, writer, outcome = results.get(timeout=300)
        outcomes[step][writer] = outcome
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    assert ckptstore.list_steps_sync(target) == list(range(rounds))
    for step in range(rounds):
        by_outcome = sorted(outcomes[step].values())
        assert by_outcome.count("won") == 1, (step, outcomes[step])
        assert all(o.startswith("lost") for o in by_outcome if o != "won"), outcomes[step]
        (winner,) = [w for w, o in outcomes[step].items() if o == "won"]
        restored = ckptstore.restore_sync(target, step=step)
        expected = tree(winner, step)
        assert restored["step"] == step
        for leaf in ("writer", "w"):
            assert restored[leaf].tobytes() == expected[leaf].tobytes()
            assert restored[leaf].dtype == expected[leaf].dtype
        assert ckptstore.verify_sync(target, step=step).ok
    at_commit = sum(o == "lost at commit" for r in outcomes.values() for o in r.values())
    print(
        f"{kind}: {rounds} rounds x {WRITERS} writers: one winner each round; "
        f"{at_commit} of {rounds * (WRITERS - 1)} losers lost the marker race itself"
    )
