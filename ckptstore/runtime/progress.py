"""A one-line progress bar for long work: items, bytes, rate and time left.

Library calls draw it when asked (``progress=True``); the ``ckptstore`` command asks only
when stderr is a terminal and the work has run ``after`` seconds (`ckptstore.cli.output`).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human(nbytes: float) -> str:
    """``512 B``, ``1.5 KiB``, ... ``3.0 TiB``: how ckptstore shows a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Redraws at most every ``interval`` seconds on ``stream`` (stderr by default), from
    ``after`` seconds on (quick work draws nothing). ``total_items`` None: bytes only."""

    def __init__(
        self,
        total_items: int | None = None,
        total_bytes: int = 0,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.2,
        label: str = "tensors",
        after: float = 0.0,
    ):
        self.total_items, self.total_bytes = total_items, total_bytes
        self.items = self.bytes = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self.label = label
        self.after = after
        self.start = time.monotonic()
        self._drawn = 0.0
        self.shown = False  # whether a line was drawn

    @classmethod
    def make(
        cls, progress: bool | Progress, total_items: int | None, total_bytes: int, label: str
    ) -> Progress:
        """The bar for work of ``total_items`` and ``total_bytes``: ``progress`` itself when
        it is one (its totals set to these; its settings kept), else a new one it enables."""
        if isinstance(progress, Progress):
            progress.total_items, progress.total_bytes = total_items, total_bytes
            return progress
        return cls(total_items, total_bytes, enabled=progress, label=label)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.bytes / elapsed
        items = "" if self.total_items is None else f" {self.items}/{self.total_items}"
        if self.total_bytes or not self.total_items:
            done, total, amount = self.bytes, self.total_bytes, f"{human(self.bytes)}/"
            amount += human(self.total_bytes)
        else:  # bytes not known ahead (removals): the share of items done, and bytes so far
            done, total, amount = self.items, self.total_items, human(self.bytes)
        fraction = done / total if total else 1.0
        left = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
        eta = _duration(left) if left == left else "?"
        return (
            f"{self.label}{items}  {amount} ({100 * fraction:.0f}%)  "
            f"{human(rate)}/s  elapsed {_duration(elapsed)}  left {eta}"
        )

    def advance(self, items: int, nbytes: int) -> None:
        self.items += items
        self.bytes += nbytes
        self._draw(self.items == self.total_items)

    def update(self, done_bytes: int, total_bytes: int) -> None:
        """Bytes done so far of ``total_bytes`` (for callbacks that report totals)."""
        self.bytes, self.total_bytes = done_bytes, total_bytes
        self._draw(done_bytes >= total_bytes)

    def _draw(self, last: bool) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.start < self.after:
            return
        if now - self._drawn >= self.interval or last:
            self._drawn = now
            self.shown = True
            self.stream.write("\r" + self.line().ljust(100))
            self.stream.flush()

    def clear(self) -> None:
        """Wipe the drawn line (before other output to the same terminal); the next
        update draws it again."""
        if self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self._drawn = 0.0

    def close(self) -> None:
        """The final line, ended, if the bar was drawn (or would have been by now)."""
        if self.enabled and (self.shown or time.monotonic() - self.start >= self.after):
            self.stream.write("\r" + self.line().ljust(100) + "\n")
            self.stream.flush()
            self.shown = False
