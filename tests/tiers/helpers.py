"""Helpers the tier tests share: a step's tree and its check, a small fast-tier disk, an
S3 durable tier that gives up fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.backends.s3 import S3Backend

# ---- a step's tree (test_tiers.py) ----


def tree(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((256, 128)).astype(np.float32),
        "b": np.full(7, step, np.int16),
        "step": step,
    }


def assert_tree(restored: dict[str, Any], step: int) -> None:
    expected = tree(step)
    assert restored["step"] == step
    for key in ("w", "b"):
        assert restored[key].dtype == expected[key].dtype
        assert restored[key].tobytes() == expected[key].tobytes()


# ---- room on the fast tier (test_room.py) ----

STEP_BYTES = 256 * 128 * 4 + 7 * 2 + 8  # one tree(step)'s payload


class SmallDisk(LocalBackend):
    """A local tier on a disk of ``capacity`` bytes."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(root)
        self.capacity = capacity

    async def free_bytes(self) -> int | None:
        used = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
        return self.capacity - used


def tiers_on(tmp_path: Path, capacity: int, margin: int = 4096) -> ckptstore.Tiered:
    fast = SmallDisk(tmp_path / "nvme", capacity)
    return ckptstore.Tiered(fast, str(tmp_path / "bucket"), free_margin=margin)


# ---- a durable tier that gives up fast (test_outage.py, lifecycle/test_existence.py) ----


def impatient_s3(
    bucket: str,
    endpoint: str,
    *,
    attempts: int = 2,
    base_delay: float = 0.01,
    max_delay: float = 0.05,
    connect_timeout: float = 0.5,
    read_timeout: float = 0.5,
) -> S3Backend:
    """An S3 backend on ``endpoint`` (a `FaultProxy` in front of moto) that gives up on a
    dead server within about a second by default: two attempts, 0.5 s connect and read
    timeouts (`tests/campaigns/outage.py` gives it a job's more patient settings)."""
    return S3Backend(
        bucket,
        "run",
        endpoint_url=endpoint,
        credentials="env",
        retry=RetryPolicy(max_attempts=attempts, base_delay=base_delay, max_delay=max_delay),
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
    )
