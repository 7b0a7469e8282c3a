"""What host work slows an accelerator's training step (`accelerator.py --parts interference`).

The loop part (`accelerator_loop`) measures what a loop loses per save; this part takes the
save apart, with the loop's own donated step (`make_step`) on the LLM-like tree, steps run
back to back and each waited for:

1. **host load** (`host_load`): 40 steps beside ``k`` threads of one kind of host work, the
   median step against 40 steps without: numpy copies of 64 MiB (the interpreter lock
   released), ``os.pwrite`` of 16 MiB into the scratch directory, a pure-Python spin (the lock
   held), device-to-host transfers of 64 MiB, fresh 64 MiB host arrays made and freed.
2. **writers of a host tree** (`writers`): the tree fetched to host numpy arrays first (no
   transfer during the write), then one write of it on a background thread while steps run:
   ``os.write`` into one file (fsync at the end), TensorStore zarr3 inside OCDBT with its
   default context, ``ckptstore.save_sync`` and a `CheckpointManager` (``staging="host"``).
   Per writer: the write's time, the steps beside it, those slowed (> 1.3x the median step
   without a write) and the time they lost (above that median).

    python benchmarks/accelerator.py --parts interference --mib 4096 --reps 2   # TPU, ~2 min
    python benchmarks/accelerator.py --dry --parts interference                  # CPU (make test)
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

import ckptstore
from benchmarks.accelerator_loop import make_step, make_tree

MiB = 1 << 20
Work = Callable[[threading.Event, Path], None]


def _copies(stop: threading.Event, scratch: Path) -> None:
    a = np.ones(16 * MiB, np.float32)
    b = np.empty_like(a)
    while not stop.is_set():
        np.copyto(b, a)


def _pwrites(stop: threading.Event, scratch: Path) -> None:
    data = np.ones(16 * MiB, np.uint8)
    fd = os.open(scratch / f"load-{threading.get_ident()}", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while not stop.is_set():
            os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def _spin(stop: threading.Event, scratch: Path) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def _transfers(stop: threading.Event, scratch: Path) -> None:
    x = jnp.ones(16 * MiB, jnp.float32)
    while not stop.is_set():
        y = x + 0
        np.asarray(y)
        y.delete()


def _fresh_arrays(stop: threading.Event, scratch: Path) -> None:
    while not stop.is_set():
        a = np.ones(16 * MiB, np.float32)
        del a


LOADS: dict[str, Work] = {
    "numpy copies (lock released)": _copies,
    "os.pwrite into the scratch directory": _pwrites,
    "pure-Python spin (lock held)": _spin,
    "device-to-host transfers": _transfers,
    "fresh host arrays made and freed": _fresh_arrays,
}


class Stepper:
    """The loop's donated step on a tree, run and waited for one step at a time."""

    def __init__(self, tree: Any, dry: bool) -> None:
        self.tree = tree
        self.step, self.weight = make_step(dry)
        self.run(3)  # compiled, warm

    def run(self, n: int | None = None, until: threading.Event | None = None) -> np.ndarray:
        """``n`` steps, or steps until ``until`` is set; their times in ms."""
        times = []
        while (n is not None and len(times) < n) or (until is not None and not until.is_set()):
            t = time.perf_counter()
            self.tree = jax.block_until_ready(self.step(self.tree, self.weight))
            times.append(time.perf_counter() - t)
        return np.array(times) * 1e3


def host_load(stepper: Stepper, scratch: Path, dry: bool) -> list[dict[str, Any]]:
    """Part 1 (module docstring): per kind of load and thread count, the median step."""
    counts = {"numpy copies (lock released)": (2,) if dry else (4, 8, 13, 26)}
    steps = 5 if dry else 40
    rows = []
    for kind, work in LOADS.items():
        for k in counts.get(kind, (1,) if dry else (1, 4)):
            base = stepper.run(steps)
            stop = threading.Event()
            threads = [threading.Thread(target=work, args=(stop, scratch)) for _ in range(k)]
            for t in threads:
                t.start()
            time.sleep(0.2)
            loaded = stepper.run(steps)
            stop.set()
            for t in threads:
                t.join()
            row = {
                "load": kind,
                "threads": k,
                "base_ms": round(float(np.median(base)), 1),
                "median_ms": round(float(np.median(loaded)), 1),
                "max_ms": round(float(loaded.max()), 1),
            }
            print(f"host load: {row}", flush=True)
            rows.append(row)
    return rows


def _host_leaves(tree: Any) -> list[np.ndarray]:
    keys = jax.dtypes.prng_key
    return [
        np.array(jax.random.key_data(x) if jnp.issubdtype(x.dtype, keys) else x)
        for x in jax.tree.leaves(tree)
    ]


def _os_write(leaves: list[np.ndarray], where: Path) -> None:
    fd = os.open(where / "all.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in leaves:
            view = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensorstore(leaves: list[np.ndarray], where: Path) -> None:
    kv = {"driver": "ocdbt", "base": {"driver": "file", "path": f"{where}/ts/"}}
    writes = []
    for i, a in enumerate(leaves):
        if a.ndim == 0:
            continue
        chunk = list(a.shape)
        if a.nbytes > 64 * MiB:
            chunk[0] = max(1, chunk[0] * 64 * MiB // a.nbytes)
        grid = {"name": "regular", "configuration": {"chunk_shape": chunk}}
        metadata = {"shape": list(a.shape), "data_type": str(a.dtype), "chunk_grid": grid}
        spec = {"driver": "zarr3", "kvstore": {**kv, "path": f"l{i}/"}, "metadata": metadata}
        writes.append(ts.open(spec, create=True).result().write(a))
    for w in writes:
        w.result()


def _save_sync(leaves: list[np.ndarray], where: Path) -> None:
    ckptstore.save_sync(str(where / "ck"), {f"l{i:03d}": a for i, a in enumerate(leaves)}, step=1)


def _manager(leaves: list[np.ndarray], where: Path) -> None:
    options = ckptstore.ManagerOptions(staging="host", handle_sigterm=False)
    with ckptstore.CheckpointManager(str(where / "mg"), options=options) as mgr:
        mgr.save(1, {f"l{i:03d}": a for i, a in enumerate(leaves)})
        mgr.wait_until_finished()


WRITERS: dict[str, Callable[[list[np.ndarray], Path], None]] = {
    "os.write, one file, fsync": _os_write,
    "TensorStore zarr3 in OCDBT (its defaults)": _tensorstore,
    "ckptstore.save_sync": _save_sync,
    "CheckpointManager, staging=host": _manager,
}


def writers(stepper: Stepper, scratch: Path, reps: int) -> list[dict[str, Any]]:
    """Part 2 (module docstring): per round and writer, what the steps beside it lost."""
    leaves = _host_leaves(stepper.tree)
    base = float(np.median(stepper.run(20)))
    rows = []
    for rep in range(reps):
        for who, write in WRITERS.items():
            where = scratch / "writes"
            where.mkdir()
            done = threading.Event()
            took: list[float] = []

            def run(
                write: Any = write, where: Path = where, done: Any = done, took: Any = took
            ) -> None:
                t = time.perf_counter()
                try:
                    write(leaves, where)
                finally:
                    took.append(time.perf_counter() - t)
                    done.set()

            thread = threading.Thread(target=run)
            thread.start()
            steps = stepper.run(until=done)
            thread.join()
            shutil.rmtree(where)
            row = {
                "round": rep + 1,
                "who": who,
                "write_s": round(took[0], 3),
                "steps": len(steps),
                "slowed": int((steps > 1.3 * base).sum()),
                "lost_s": round(float((steps - base).clip(0).sum()) / 1e3, 3),
            }
            print(f"writers: {row}", flush=True)
            rows.append(row)
    return rows


def interference_part(scratch: Path, dry: bool, mib: int, reps: int) -> dict[str, Any]:
    """Both measures (module docstring) on the LLM-like tree of ``mib``."""
    stepper = Stepper(make_tree("llm", mib), dry)
    return {
        "host_load": host_load(stepper, scratch, dry),
        "writers": writers(stepper, scratch, reps),
    }
