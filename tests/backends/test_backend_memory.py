from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import ckptstore
from ckptstore.backends.memory import MemoryBackend, forget
from ckptstore.testing.conformance import BackendTests


class TestMemoryBackend(BackendTests):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[MemoryBackend]:
        async with MemoryBackend() as b:
            yield b
        forget(b.name)


async def test_same_name_shares_bytes() -> None:
    a = MemoryBackend("shared-test")
    b = MemoryBackend("shared-test")
    await a.write("k", b"v")
    assert await b.read("k") == b"v"
    assert await MemoryBackend("other-test").exists("k") is False
    forget("shared-test")


async def test_fault_wrapper_adds_latency_and_counts_only_chosen_ops() -> None:
    import time

    from ckptstore.testing.faults import FaultyBackend

    inner = MemoryBackend()
    faulty = FaultyBackend(inner, latency=0.05, ops={"read"}, fail_rate=1.0)
    start = time.monotonic()
    await faulty.write("k", b"v")  # not a faulted op: succeeds, still delayed
    await faulty.stat("k")
    assert time.monotonic() - start >= 0.1
    assert faulty.calls == 0
    with pytest.raises(ckptstore.TransientStorageError):
        await faulty.read("k")
    assert (faulty.calls, faulty.injected) == (1, 1)
    with pytest.raises(ValueError, match="unknown operations"):
        FaultyBackend(inner, ops={"reed"})
    forget(inner.name)
