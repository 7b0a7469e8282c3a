from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ckptstore.backends.memory import MemoryBackend, forget
from tests.conformance import BackendConformance


class TestMemoryBackend(BackendConformance):
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
