"""The loop part's profile (`accelerator.py --parts loop --profile`): what slows the
training steps while a save writes.

One run each of no checkpointing, the hardware's drain and ckptstore (and ckptstore under
each of ``--variants``, experiments on its write path: `apply_variant`), after a warm-up,
with two instruments: `benchmarks.timeline.TIMELINE` (each step split into its dispatch and
its wait, beside the save's device-to-host transfers and TensorStore writes: for the slowed
steps, what ran beside them) and `LockSampler` (a thread waking every 2 ms: how often and
how long another thread kept it from running Python).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.accelerator_loop import make_step, one_run
from benchmarks.timeline import TIMELINE


def hook_ckptstore() -> None:
    """Record ckptstore's device-to-host transfers and TensorStore writes on `TIMELINE`."""
    from ckptstore.datapath import arrays
    from ckptstore.lifecycle import devicecopy

    if getattr(devicecopy.DrainedPiece, "_timed", False):
        return
    to_host = devicecopy.DrainedPiece.__array__

    def timed_to_host(self: Any, *args: Any, **kwargs: Any) -> Any:
        with TIMELINE.span("transfer"):
            return to_host(self, *args, **kwargs)

    written = arrays.LeafWriter.written

    async def timed_written(self: Any, *args: Any, **kwargs: Any) -> Any:
        with TIMELINE.span("write"):
            return await written(self, *args, **kwargs)

    devicecopy.DrainedPiece.__array__ = timed_to_host  # type: ignore[method-assign]
    arrays.LeafWriter.written = timed_written  # type: ignore[method-assign]
    devicecopy.DrainedPiece._timed = True  # type: ignore[attr-defined]


def apply_variant(variant: str) -> Callable[[], None]:
    """Experiments on ckptstore's write path for `profile` ("+"-joined): ``copyN``: TensorStore
    copies and file I/O of the local backend on N threads; ``noevict``: no page-cache
    eviction thread; ``nogc``: no young collection per drained piece; ``keephost``: every
    drained piece's host copy kept until the undo (no frees while the saves write);
    ``serial``: one drained piece moved to the host at a time; ``switch``: the interpreter's
    switch interval 0.5 ms (5 ms by default). Returns the undo."""
    from ckptstore.backends import local
    from ckptstore.lifecycle import devicecopy

    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, value: Any) -> Any:
        """Set ``owner.name`` to ``value`` until the undo; returns what it was."""
        old = getattr(owner, name)
        setattr(owner, name, value)
        undo.append(lambda: setattr(owner, name, old))
        return old

    piece = devicecopy.DrainedPiece
    for part in filter(None, variant.split("+")):
        if part.startswith("copy"):
            patch(local.LocalBackend, "_new_ts_context", _limited_context(int(part[4:])))
        elif part == "noevict":
            patch(local.LocalBackend, "write_behind", lambda self, prefix: contextlib.nullcontext())
        elif part == "nogc":
            patch(devicecopy, "release_deferred", lambda: None)
        elif part == "switch":
            old_interval = sys.getswitchinterval()
            sys.setswitchinterval(0.0005)
            undo.append(functools.partial(sys.setswitchinterval, old_interval))
        elif part == "serial":
            patch(piece, "__array__", _serially(piece.__array__, threading.Lock()))
        elif part == "keephost":
            kept: list[Any] = []
            patch(piece, "__array__", _keeping(piece.__array__, kept))
            undo.append(kept.clear)
        else:
            raise ValueError(f"unknown variant {part!r}")

    def run() -> None:
        for u in reversed(undo):
            u()

    return run


def _limited_context(n: int) -> Callable[[Any], Any]:
    """`LocalBackend._new_ts_context` with TensorStore's copies and file I/O on ``n`` threads."""

    def context(self: Any) -> Any:
        import tensorstore as ts

        return ts.Context(
            {
                "file_io_concurrency": {"limit": n},
                "data_copy_concurrency": {"limit": n},
                "file_io_sync": self.fsync,
            }
        )

    return context


def _serially(to_host: Callable[..., Any], one: threading.Lock) -> Callable[..., Any]:
    """``to_host`` (a drained piece's move to the host), one call at a time."""

    def serially(self: Any, *args: Any, **kw: Any) -> Any:
        with one:
            return to_host(self, *args, **kw)

    return serially


def _keeping(to_host: Callable[..., Any], kept: list[Any]) -> Callable[..., Any]:
    """``to_host``, its result also appended to ``kept`` (never freed while kept)."""

    def keeping(self: Any, *args: Any, **kw: Any) -> Any:
        host = to_host(self, *args, **kw)
        kept.append(host)
        return host

    return keeping


# -- what holds the interpreter lock -----------------------------------------------------


class LockSampler:
    """A thread waking every 2 ms; a wake later than ``late`` seconds means another thread
    held the interpreter lock: what every other thread runs then is counted (innermost
    frames of the project, TensorStore, JAX and numpy, and the innermost frame)."""

    def __init__(self, late: float = 0.02) -> None:
        self.late = late
        self.gaps: list[float] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lock-sampler", daemon=True)

    def __enter__(self) -> LockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        last = time.perf_counter()
        while not self._stop.wait(0.002):
            now = time.perf_counter()
            gap, last = now - last, now
            if gap < self.late:
                continue
            self.gaps.append(gap)
            names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame)[-12:]
                inner = " <- ".join(
                    f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack[-4:])
                )
                self.counts[f"{_short(names.get(ident, '?'))}: {inner}"] += 1

    def to_json(self) -> dict[str, Any]:
        gaps = sorted(self.gaps)
        return {
            "late_wakes": len(gaps),
            "longest_ms": round(1000 * gaps[-1], 1) if gaps else 0.0,
            "median_ms": round(1000 * gaps[len(gaps) // 2], 1) if gaps else 0.0,
            "stacks": self.counts.most_common(25),
        }


def _short(name: str) -> str:
    return name.rstrip("0123456789_").rstrip("-")


def profile(
    tree: Any, root: Path, dry: bool, every: int, saves: int, variants: list[str]
) -> tuple[Any, dict[str, Any]]:
    """One run of ckptstore, the drain and no checkpointing under `LockSampler`; returns
    the state the runs ended with and what the sampler found."""
    step_fn, weight = make_step(dry)
    out: dict[str, Any] = {}
    hook_ckptstore()
    for who in ("none", "drain", "ckptstore"):  # compiles and first saves, not counted
        tree, _ = one_run(who, tree, root, step_fn, weight, 2, 1)
    runs = [("none", ""), ("drain", "")] + [("ckptstore", v) for v in variants]
    for who, variant in runs:
        undo = apply_variant(variant)
        try:
            with LockSampler() as sampler, TIMELINE.recording():
                tree, got = one_run(who, tree, root, step_fn, weight, every, saves)
        finally:
            undo()
        if who == "none":
            base = float(np.median(got["step_s"]))
            base_loop = got["loop_s"]
        label = f"{who}{'+' + variant if variant else ''}"
        out[label] = {
            **sampler.to_json(),
            "loop_s": round(got["loop_s"], 3),
            "lost_per_save_s": round((got["loop_s"] - base_loop) / saves, 3),
            "durable_after_s": round(got["durable_after_s"], 3),
            "rss_added_gib": round(got["rss_added"] / (1 << 30), 3),
            "timeline": TIMELINE.overlaps(base),
        }
        print(
            f"profile {label}: lost/save {out[label]['lost_per_save_s']} s, durable after"
            f" {out[label]['durable_after_s']} s, RSS +{out[label]['rss_added_gib']} GiB,"
            f" {out[label]['timeline']}",
            flush=True,
        )
        print(f"profile {label}: {out[label]['late_wakes']} late wakes", flush=True)
    return tree, out
