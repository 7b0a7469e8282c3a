"""Where a test finds what a save stored: the committed attempt, or every attempt of a step."""

from __future__ import annotations

from pathlib import Path

from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.commit import read_marker


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
    file of an OCDBT store, or a pack of small leaves (`ckptstore.packs`)."""
    files = [p for p in below.rglob("ocdbt.process_*/**/*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)
