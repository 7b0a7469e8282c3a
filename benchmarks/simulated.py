"""P processes of a multi-process save simulated in one OS process (`benchmarks/scale.py`).

Each simulated process is an asyncio task that sets `PROCESS` to its index, then runs the
real `ckptstore.save` on a backend of its own. While `Simulated` is entered,
`ckptstore.runtime.distributed` (the package's whole interface to jax.distributed) answers
as that process of P: `process_index`, `process_count`, `unique_name` (counted per process,
as each real process counts its own) and `kv_set` / `kv_get`, through `SimulatedKV`, an
in-memory key-value store with the coordination service's semantics (a get waits for its
key, up to its timeout). Everything below that line is the package's own code.
`counting_backend` and `ts_requests` count the storage requests a process makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

#: TensorStore's own requests to the storage under OCDBT, from its metrics.
TS_OPS = ("read", "write", "list", "delete_range")

#: The simulated process a task runs as (each task sets it before it calls `save`).
PROCESS: contextvars.ContextVar[int] = contextvars.ContextVar("simulated_process")


class SimulatedKV:
    """The coordination service's key-value store, in memory: a set publishes, a get
    waits (up to its timeout) for the key. Counts messages and bytes per process."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.sets: Counter[int] = Counter()
        self.gets: Counter[int] = Counter()
        self.bytes: Counter[int] = Counter()
        self.reported: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.last_set: dict[int, float] = {}  # per process, when its last set was made
        self.last_get: dict[int, float] = {}  # and when its last get returned

    async def kv_set(self, key: str, value: str) -> None:
        me = PROCESS.get()
        self.sets[me] += 1
        self.bytes[me] += len(key) + len(value)
        self.values[key] = value
        self.events[key].set()
        self.last_set[me] = time.perf_counter()
        if "/report/" in key:  # this process is done writing (or failed): the next may start
            self.reported[me].set()

    async def kv_get(self, key: str, timeout: float = 600.0) -> str:
        from ckptstore.errors import CoordinationError

        me = PROCESS.get()
        self.gets[me] += 1
        try:
            await asyncio.wait_for(self.events[key].wait(), timeout)
        except TimeoutError as exc:
            raise CoordinationError(f"process {me}: no value for {key!r} in {timeout} s") from exc
        value = self.values[key]
        self.bytes[me] += len(key) + len(value)
        self.last_get[me] = time.perf_counter()
        return value


class Simulated:
    """While entered, `ckptstore.runtime.distributed` answers as process `PROCESS` of
    ``count``, with `SimulatedKV` as its coordination store. Only those five functions
    are replaced; they are the package's whole interface to jax.distributed."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.kv = SimulatedKV()
        self._names: defaultdict[int, Counter[str]] = defaultdict(Counter)
        self._stack = contextlib.ExitStack()

    def unique_name(self, label: str) -> str:  # per process, as each real one counts its own
        uses = self._names[PROCESS.get()]
        uses[label] += 1
        return f"ckptstore/{label}/{uses[label]}"

    def __enter__(self) -> Simulated:
        from ckptstore.runtime import distributed

        patch = self._stack.enter_context
        patch(mock.patch.object(distributed, "process_index", lambda: PROCESS.get()))
        patch(mock.patch.object(distributed, "process_count", lambda: self.count))
        patch(mock.patch.object(distributed, "unique_name", self.unique_name))
        patch(mock.patch.object(distributed, "kv_set", self.kv.kv_set))
        patch(mock.patch.object(distributed, "kv_get", self.kv.kv_get))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def counting_backend(inner: Any, counts: Counter[str]) -> Any:
    """``inner`` behind a `Backend` that counts each byte-API call (and directory syncs)
    in ``counts`` by operation; nothing else changes (a `FaultyBackend` with no faults)."""
    from ckptstore.backends import supports
    from ckptstore.testing.faults import FaultyBackend

    class Counting(FaultyBackend):
        async def _around(
            self, op: str, key: str | None, call: Callable[[], Awaitable[Any]]
        ) -> Any:
            counts[op] += 1
            return await call()

        async def sync_dirs(self, prefix: str) -> None:
            counts["sync_dirs"] += 1
            await supports.sync_dirs(self.inner, prefix)

    return Counting(inner, ops=())


def ts_requests() -> Counter[str]:
    """TensorStore's kvstore requests so far, by operation, over the storage drivers."""
    import tensorstore as ts

    out: Counter[str] = Counter()
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        driver, _, op = metric["name"].removeprefix("/tensorstore/kvstore/").partition("/")
        if driver in ("file", "s3", "gcs") and op in TS_OPS:
            out[op] += int(metric["values"][0].get("value", 0))
    return out
