"""The cyclic collector is paused during restores and back on, as it was, afterwards."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.runtime import futures
from ckptstore.runtime.gcpause import gc_paused


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    gc.enable()
    yield
    gc.enable()


def test_nesting_and_errors_restore_the_collector() -> None:
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_in_threads_end_with_the_last() -> None:
    entered, release = threading.Barrier(2), threading.Event()

    def hold() -> None:
        with gc_paused():
            entered.wait()
            release.wait()

    other = threading.Thread(target=hold)
    other.start()
    with gc_paused():
        entered.wait()
    assert not gc.isenabled()  # the other thread's pause is still on
    release.set()
    other.join()
    assert gc.isenabled()


class Watching(LocalBackend):
    """Records whether the collector was on while a restore read or a save wrote."""

    seen: ClassVar[list[bool]] = []
    seen_writing: ClassVar[list[bool]] = []

    async def _read_into(self, key, offset, outs):  # type: ignore[no-untyped-def]
        type(self).seen.append(gc.isenabled())
        return await super()._read_into(key, offset, outs)

    async def _create(self, key, data):  # type: ignore[no-untyped-def]
        type(self).seen_writing.append(gc.isenabled())
        return await super()._create(key, data)


async def test_restore_pauses_the_collector_and_turns_it_back_on(tmp_path: Path) -> None:
    tree = {f"v{i}": np.full(100 + i, i, np.float32) for i in range(20)}
    backend = Watching(tmp_path)
    await ckptstore.save(backend, tree, step=1)
    out = await ckptstore.restore(backend)
    assert Watching.seen and not any(Watching.seen)
    assert gc.isenabled()
    np.testing.assert_array_equal(out["v3"], tree["v3"])
    with pytest.raises(CheckpointNotFoundError):
        await ckptstore.restore(backend, step=7)
    assert gc.isenabled()


async def test_saves_leave_the_collector_on(tmp_path: Path) -> None:
    """A manager's background save overlaps the training loop: it must not stop the
    loop's garbage collection for as long as it runs."""
    backend = Watching(tmp_path)
    await ckptstore.save(backend, {"w": np.ones(10, np.float32)}, step=1)
    assert Watching.seen_writing and all(Watching.seen_writing)  # the commit marker's create


async def test_a_save_pauses_the_collector_only_while_it_describes_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Describing thousands of leaves builds thousands of objects in one synchronous step:
    the collector is off for that step, and on again before any I/O."""
    from ckptstore.checkpoint import save as save_module

    seen_describing: list[bool] = []
    real = save_module.describe_leaf

    def describe_leaf(name: str, value: object, *rest: int) -> object:
        seen_describing.append(gc.isenabled())
        return real(name, value, *rest)

    monkeypatch.setattr(save_module, "describe_leaf", describe_leaf)
    Watching.seen_writing.clear()
    backend = Watching(tmp_path)
    await ckptstore.save(backend, {f"v{i}": np.ones(4, np.float32) for i in range(5)}, step=1)
    assert seen_describing == [False] * 5
    assert Watching.seen_writing and all(Watching.seen_writing)
    assert gc.isenabled()


async def test_a_save_pauses_the_collector_while_it_encodes_its_manifest_and_pack_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest and the pack records hold an object per leaf: encoding and parsing them
    are synchronous steps with the collector off (a 5,000-leaf commit spent ~90 ms in
    collections there); the writes around them run with it on."""
    from ckptstore.format import packs
    from ckptstore.format.leaves import LeafInfo

    seen: dict[str, list[bool]] = {"leaf": [], "ref": [], "ref parsed": []}
    leaf_to_json, ref_to_json = LeafInfo.to_json, packs.PackRef.to_json
    ref_from_json = packs.PackRef.from_json.__func__  # type: ignore[attr-defined]

    def watch_leaf(self: LeafInfo) -> dict[str, object]:
        seen["leaf"].append(gc.isenabled())
        return leaf_to_json(self)

    def watch_ref(self: packs.PackRef) -> dict[str, object]:
        seen["ref"].append(gc.isenabled())
        return ref_to_json(self)

    def watch_ref_parse(cls: type[packs.PackRef], leaf: str, data: object) -> packs.PackRef:
        seen["ref parsed"].append(gc.isenabled())
        return ref_from_json(cls, leaf, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(LeafInfo, "to_json", watch_leaf)
    monkeypatch.setattr(packs.PackRef, "to_json", watch_ref)
    monkeypatch.setattr(packs.PackRef, "from_json", classmethod(watch_ref_parse))
    Watching.seen_writing.clear()
    backend = Watching(tmp_path)
    tree = {f"v{i}": np.ones(4, np.float32) for i in range(5)}
    await ckptstore.save(backend, tree, step=1)
    # Each leaf: its record in the manifest; its pack reference in the writer's index and
    # in the manifest, parsed back from the index and from the manifest's check.
    assert seen["leaf"] and not any(seen["leaf"]), seen
    assert seen["ref"] and not any(seen["ref"]), seen
    assert seen["ref parsed"] and not any(seen["ref parsed"]), seen
    assert Watching.seen_writing and all(Watching.seen_writing)
    assert gc.isenabled()


def _root(array: np.ndarray) -> np.ndarray:
    """The array that owns ``array``'s memory (the end of its chain of views)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


@pytest.mark.parametrize("leaves", [30, 1])
async def test_a_restored_trees_memory_goes_with_it_with_the_collector_off(
    tmp_path: Path, leaves: int
) -> None:
    """Programs that turn the cyclic collector off (training loops often do) must get a
    restored tree's memory back when they drop the tree: a restore leaves no reference
    cycle holding its buffers (packed small leaves and a leaf of its own store)."""
    size = 1000 if leaves > 1 else 300_000
    tree = {f"v{i}": np.arange(size + i, dtype=np.float32) for i in range(leaves)}
    await ckptstore.save(str(tmp_path), tree, step=1)
    gc.collect()
    gc.disable()
    out = await ckptstore.restore(str(tmp_path))
    np.testing.assert_array_equal(out["v0"], tree["v0"])
    buffers = [weakref.ref(_root(out[name])) for name in tree]
    del out
    assert [ref for ref in buffers if ref() is not None] == []


class _LingeringExecutor(concurrent.futures.Executor):
    """Like a `ThreadPoolExecutor` worker that the scheduler takes off the CPU right after
    it set a future's result: its frame still holds the function and what it returned."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            result = fn(*args, **kwargs)
            future.set_result(result)
            time.sleep(0.5)  # `fn` and `result` are still referenced here
            del result

        threading.Thread(target=run, daemon=True).start()
        return future


async def test_a_worker_thread_holds_nothing_once_the_call_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `off_loop` returns (a restore's decoded buffer) is the caller's alone once it
    returns, however late the worker thread runs again (issue: a restored tree outlived
    `del` under load)."""
    monkeypatch.setattr(futures, "_CPU", _LingeringExecutor())
    nbytes = 2 * futures.THREAD_BYTES
    made = await futures.off_loop(lambda: np.ones(nbytes // 4, np.float32), nbytes)
    ref = weakref.ref(made)
    del made
    assert ref() is None
