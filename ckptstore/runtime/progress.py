"""A one-line progress bar for long imports: items, bytes, rate and time left."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Redraws at most every ``interval`` seconds on ``stream`` (stderr by default)."""

    def __init__(
        self,
        total_items: int,
        total_bytes: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.2,
        label: str = "tensors",
    ):
        self.total_items, self.total_bytes = total_items, total_bytes
        self.items = self.bytes = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self.label = label
        self.start = time.monotonic()
        self._drawn = 0.0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.bytes / elapsed
        left = (self.total_bytes - self.bytes) / rate if rate > 0 else float("nan")
        eta = _duration(left) if left == left else "?"
        pct = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"{self.label} {self.items}/{self.total_items}  "
            f"{_size(self.bytes)}/{_size(self.total_bytes)} ({pct:.0f}%)  "
            f"{_size(rate)}/s  elapsed {_duration(elapsed)}  left {eta}"
        )

    def advance(self, items: int, nbytes: int) -> None:
        self.items += items
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= self.interval or self.items == self.total_items):
            self._drawn = now
            self.stream.write("\r" + self.line().ljust(100))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line().ljust(100) + "\n")
            self.stream.flush()
