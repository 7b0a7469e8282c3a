"""Where a test finds what a save stored: the committed attempt, or every attempt of a step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from ckptstore.backends.base import Backend
from ckptstore.format import layout
from ckptstore.protocol import read_marker


async def committed_root(backend: Backend, step: int) -> str:
    """``<step>/<attempt>`` of the attempt the step's marker names."""
    marker = await read_marker(backend, step)
    assert marker is not None, f"step {step} is not committed"
    return marker.where.root


async def attempts(backend: Backend, step: int) -> list[str]:
    """Every attempt directory below ``step``, committed or not."""
    return [n for n in await backend.list_dir(layout.step_dir(step)) if layout.is_attempt(n)]


def largest_data_file(below: Path) -> Path:
    """The largest file of the per-process stores below ``below`` on local disk: a data
    file of an OCDBT store, or a pack of small leaves (`ckptstore.format.packs`)."""
    files = [p for p in below.rglob("ocdbt.process_*/**/*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@contextlib.contextmanager
def a_day_later() -> Iterator[None]:
    """As if a day had passed, for gc: commit claims that never got a marker, and the fate
    records of collected attempts (tombstones), expire (`fates.CLAIM_TTL`)."""
    from ckptstore.protocol import fates

    ttl, fates.CLAIM_TTL = fates.CLAIM_TTL, 0.0
    try:
        yield
    finally:
        fates.CLAIM_TTL = ttl
