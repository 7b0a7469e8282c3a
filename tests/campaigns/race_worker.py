"""One of N OS processes that all save the same steps at the same moment
(tests/campaigns/test_race.py).

Each round every process waits at a barrier, then saves its own tree as step
``round`` and reports "won", "lost" (`AlreadyExistsError` from the early check),
"lost at commit" (`AlreadyExistsError` from the marker's create-if-absent, all its
data written) or the unexpected error.
"""

from __future__ import annotations

import asyncio
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np


def tree(writer: int, step: int) -> dict[str, Any]:
    return {
        "writer": np.full(4096, writer, np.int32),
        "step": step,
        "w": np.arange(8192, dtype=np.float32) * (writer + 1),
    }


def run(target: str, writer: int, rounds: int, barrier: Barrier, results: Queue[Any]) -> None:
    import ckptstore

    for step in range(rounds):
        barrier.wait(timeout=120)
        try:
            asyncio.run(ckptstore.save(target, tree(writer, step), step=step))
            outcome = "won"
        except ckptstore.AlreadyExistsError as exc:  # refused up front, or lost the marker race
            outcome = "lost at commit" if "committed by another writer" in str(exc) else "lost"
        except Exception as exc:  # reported, and the test fails on it
            outcome = f"error {type(exc).__name__}: {exc}"
        results.put((step, writer, outcome))
