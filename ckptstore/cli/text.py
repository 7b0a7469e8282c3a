"""Text the ``ckptstore`` command prints: sizes, counts, times, durations."""

from __future__ import annotations

import time

from ckptstore.runtime.progress import human as human  # the one byte formatter


def count(n: int, word: str, plural: str | None = None) -> str:
    """``1 part``, ``2 parts``, ``3 leaves`` (with ``plural``)."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
