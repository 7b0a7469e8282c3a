"""Nothing ckptstore does holds the event loop it runs on: device-to-host copies, chunk
encoding and checksums, splitting coalesced reads and device placement go to threads, so
another coroutine of the user's program (a data loader, a heartbeat, a metrics exporter)
keeps running through a save, a restore and a verify.

The loop runs in asyncio's debug mode. Each callback's CPU time on the loop's thread is
measured and must stay under 50 ms: CPU time, because asyncio's own slow-callback report is
wall time, which on a shared 2-core machine also counts the moments the thread was not
scheduled at all (those reports are printed, not asserted)."""

from __future__ import annotations

import asyncio
import gc
import logging
import reprlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore import api
from ckptstore.checkpoint import restore, save, verify
from tests.checkpoint.helpers import Built, large_and_small, many_small

SLOW = 0.05  # seconds of the loop thread's CPU time one callback may take
# Imported up front (`ckptstore.save` imports `api` when first used): a first import is not
# a save's work.
assert api and restore and save and verify


class Ticker:
    """A coroutine that wakes every 2 ms and counts its wake-ups."""

    def __init__(self) -> None:
        self.ticks = 0
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(0.002)
            self.ticks += 1

    async def stop(self) -> None:
        self._stop.set()
        await self._task


@pytest.fixture
def callback_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[float, str]]]:
    """(CPU seconds, callback) of every event-loop callback that ran while it was set.

    Python's cyclic garbage collector may run inside any callback that allocates and take
    tens of milliseconds in a process as large as a test session; it is the interpreter's
    pause, not ckptstore's work, so its time is left out."""
    seen: list[tuple[float, str]] = []
    collecting = [0.0, 0.0]  # when the current collection started, CPU spent in collections
    thread = threading.get_ident()

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != thread:
            return
        if phase == "start":
            collecting[0] = time.thread_time()
        else:
            collecting[1] += time.thread_time() - collecting[0]

    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        start, collected = time.thread_time(), collecting[1]
        try:
            run(handle)
        finally:
            cpu = time.thread_time() - start - (collecting[1] - collected)
            what = getattr(handle._callback, "__self__", handle) if cpu > SLOW else ""
            seen.append((cpu, str(what)[:400]))

    monkeypatch.setattr(asyncio.events.Handle, "_run", timed)
    gc.callbacks.append(on_gc)
    yield seen
    gc.callbacks.remove(on_gc)


# benchmarks/trees.py's trees a (at 1/8: 128 MiB, 4 large and 150 small leaves) and c (at
# 1/20: 250 leaves), built alike.
@pytest.mark.parametrize(
    ("build", "scale"), [(large_and_small, 1 / 8), (many_small, 1 / 20)], ids=["a", "c"]
)
async def test_no_callback_holds_the_loop_during_save_restore_verify(
    build: Callable[[float, int], Built],
    scale: float,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    callback_cpu: list[tuple[float, str]],
) -> None:
    tree, like = build(scale, 0)
    jax.block_until_ready(tree)
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = SLOW
    caplog.set_level(logging.WARNING, logger="asyncio")
    ticker = Ticker()
    phases: dict[str, tuple[float, int]] = {}

    async def timed(phase: str, work: Any) -> Any:
        start, ticks = time.perf_counter(), ticker.ticks
        out = await work
        phases[phase] = (time.perf_counter() - start, ticker.ticks - ticks)
        return out

    await asyncio.sleep(0)  # ends the step that built the tree: that one is not measured
    callback_cpu.clear()
    await timed("save", ckptstore.save(tmp_path, tree, step=1))
    back = await timed("restore", ckptstore.restore(tmp_path, 1, like=like))
    report = await timed("verify", ckptstore.verify(tmp_path, 1))
    await ticker.stop()
    loop.set_debug(False)
    assert report.ok
    for path, value in jax.tree_util.tree_leaves_with_path(back):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(_at(tree, path)))
    slow = [(round(cpu, 3), what) for cpu, what in callback_cpu if cpu > SLOW]
    assert slow == [], slow
    for phase, (seconds, ticks) in phases.items():  # the other coroutine ran all along
        assert ticks >= seconds / (4 * SLOW), (phase, seconds, ticks)
    worst = max(cpu for cpu, _ in callback_cpu)
    wall = [r.getMessage()[-30:] for r in caplog.records if "took" in r.getMessage()]
    print(f"{phases}; worst callback {worst * 1e3:.1f} ms CPU; asyncio's wall-time reports {wall}")


def _at(tree: Any, path: Any) -> Any:
    for key in path:
        tree = tree[key.key]
    return tree


def test_asyncio_run_of_a_restore_never_copies_the_arrays_to_format_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`asyncio.run(ckptstore.restore(...))` on the main thread: when its task ends, Python
    3.11's `asyncio.Runner` formats the task, restored tree included (`signal.getsignal` of
    its SIGINT handler, `ckptstore.runtime.shortrepr`). A jax array's full repr copies it to
    the host; the abbreviated one `reprlib` uses there now reads only shape and dtype."""
    on = NamedSharding(Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y")), P("x"))
    tree = {f"w{i}": jax.device_put(np.full((64, 8), i, np.float32), on) for i in range(3)}
    tree["key"] = jax.random.split(jax.random.key(0), 4)
    ckptstore.save_sync(tmp_path, tree, step=1)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    full = []
    for cls in {type(tree["w0"]), type(tree["key"])}:
        monkeypatch.setattr(cls, "__repr__", lambda self, cls=cls: full.append(cls) or "<full>")
    # The trap is armed only where asyncio.run installs its own SIGINT handler: on the main
    # thread, over Python's default one (a job started in the background ignores SIGINT).
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = asyncio.run(ckptstore.restore(tmp_path, step=1, like=like))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert full == []
    assert sorted(out) == sorted(tree)
    assert repr(tree["w0"]) == "<full>"  # full reprs are the arrays' own, as before
    assert reprlib.repr(out).startswith(
        "{'key': <jax.Array key<fry>[4]>, 'w0': <jax.Array float32[64,8]>"
    )
