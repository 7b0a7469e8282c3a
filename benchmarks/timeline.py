"""Intervals of a run by kind, and what ran beside the slowed training steps (the loop part's
profile, `benchmarks/loop_profile.py`): "step", "dispatch" and "save_call" from the loop,
"transfer" and "write" from the save's write path."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

#: A step slower than this share of the baseline's median step is "slowed".
SLOW = 1.3


class Timeline:
    """Intervals by kind ("step", "dispatch", "save_call", "transfer", "write"), recorded
    only while `recording`; `overlaps` says, for the slowed steps, what ran beside them."""

    def __init__(self) -> None:
        self.on = False
        self.spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def add(self, kind: str, start: float, end: float) -> None:
        if self.on:
            with self._lock:
                self.spans[kind].append((start, end))

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Record the ``with`` block as one interval of ``kind``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, start, time.perf_counter())

    @contextlib.contextmanager
    def recording(self) -> Iterator[Timeline]:
        """Record (anew) while the ``with`` block runs."""
        self.spans.clear()
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def overlaps(self, base_step: float) -> dict[str, Any]:
        """Slowed steps vs the others: mean dispatch time, and the share of their time
        that a transfer or a write of the save ran beside them."""

        merged: dict[str, list[tuple[float, float]]] = {}
        for kind, spans in self.spans.items():  # overlapping spans joined: time covered once
            joined: list[tuple[float, float]] = []
            for s, e in sorted(spans):
                if joined and s <= joined[-1][1]:
                    joined[-1] = (joined[-1][0], max(joined[-1][1], e))
                else:
                    joined.append((s, e))
            merged[kind] = joined

        def covered(a: float, b: float, kind: str) -> float:
            return sum(max(0.0, min(b, e) - max(a, s)) for s, e in merged.get(kind, []))

        out: dict[str, Any] = {}
        steps = self.spans.get("step", [])
        dispatch = self.spans.get("dispatch", [])
        for label, pick in (("slowed", True), ("normal", False)):
            chosen = [
                (s, d)
                for s, d in zip(steps, dispatch, strict=False)
                if ((s[1] - s[0]) > SLOW * base_step) == pick
            ]
            if not chosen:
                continue
            total = sum(s[1] - s[0] for s, _ in chosen)
            out[label] = {
                "steps": len(chosen),
                "mean_step_ms": round(1000 * total / len(chosen), 1),
                "mean_dispatch_ms": round(
                    1000 * sum(d[1] - d[0] for _, d in chosen) / len(chosen), 2
                ),
                "transfer_share": round(sum(covered(*s, "transfer") for s, _ in chosen) / total, 3),
                "write_share": round(sum(covered(*s, "write") for s, _ in chosen) / total, 3),
            }
        for kind in ("transfer", "write"):
            spans = self.spans.get(kind, [])
            if spans:
                lengths = sorted(e - s for s, e in spans)
                out[kind] = {
                    "count": len(spans),
                    "median_ms": round(1000 * lengths[len(lengths) // 2], 1),
                    "total_s": round(sum(lengths), 3),
                }
        return out


TIMELINE = Timeline()
