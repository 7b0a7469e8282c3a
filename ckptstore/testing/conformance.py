"""The conformance suite every `Backend` passes, shipped for third-party backends too.

One generic test class, one small subclass per backend (the pattern of zarr-python's
``zarr.testing.store.StoreTests``). In a ``test_*.py`` module::

    import pytest
    from ckptstore.testing.conformance import BackendTests

    class TestMyBackend(BackendTests):
        @pytest.fixture
        async def backend(self, tmp_path):
            async with MyBackend(tmp_path / "root") as b:  # a fresh, empty backend
                yield b

The tests are coroutines; with ``ckptstore[testing]`` installed, its pytest plugin runs them
(and the async fixture) on asyncio with no configuration. They cover whole-object and ranged
reads, listing (sorted, paged past 1,000 keys), deletes, create-if-absent (the commit
primitive) including a race, key validation before any I/O, TensorStore reading and writing
the same bytes through `Backend.kvstore_spec`, and retries through `FaultyBackend`. Set
``concurrent_create_xfail`` to a reason when the storage cannot decide create-if-absent
under a race (an emulator without preconditions); the race test is then an expected failure.

Importing this module imports TensorStore (the `Backend` protocol needs it) but not JAX.
See ``docs/testing.md``.
"""

from __future__ import annotations

import asyncio
import os
from typing import ClassVar

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.backends import supports
from ckptstore.backends.base import Backend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import (
    AlreadyExistsError,
    InvalidKeyError,
    NotFoundError,
    RetriesExhaustedError,
    ShortReadError,
)
from ckptstore.testing.faults import FaultyBackend, InjectedPermanentFault

__all__ = ["INVALID_KEYS", "BackendTests", "keys_of"]

MiB = 1 << 20

#: Keys every backend refuses before any I/O.
INVALID_KEYS = [
    "",
    "/abs",
    "../escape",
    "a/../../b",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "nul\x00key",
]


async def keys_of(backend: Backend, prefix: str = "") -> list[str]:
    """The keys `Backend.list` yields below ``prefix``, in its order."""
    return [info.key async for info in backend.list(prefix)]


class BackendTests:
    """Subclass, define a ``backend`` fixture yielding a fresh, empty backend, and every
    test here runs against it. The class name has no ``Test`` prefix, so importing it into
    a test module does not collect it a second time."""

    #: A reason, when the storage cannot decide create-if-absent under a race.
    concurrent_create_xfail: ClassVar[str | None] = None

    @pytest.fixture
    def backend(self) -> Backend:
        """Overridden by each subclass (sync or async, yielding or returning)."""
        pytest.fail(
            f"{type(self).__name__} must define a `backend` fixture that yields a fresh, "
            "empty Backend (see ckptstore.testing.conformance)"
        )

    # ---- whole objects ----

    async def test_roundtrip_empty(self, backend: Backend) -> None:
        await backend.write("empty", b"")
        assert await backend.read("empty") == b""
        assert (await backend.stat("empty")).size == 0

    async def test_roundtrip_multi_mib(self, backend: Backend) -> None:
        data = os.urandom(6 * MiB + 123)  # unaligned size on purpose
        await backend.write("big/blob.bin", data)
        assert await backend.read("big/blob.bin") == data
        assert (await backend.stat("big/blob.bin")).size == len(data)

    async def test_overwrite_replaces(self, backend: Backend) -> None:
        await backend.write("k", b"first version, longer")
        await backend.write("k", b"second")
        assert await backend.read("k") == b"second"

    async def test_accepts_buffer_types(self, backend: Backend) -> None:
        arr = np.arange(1000, dtype=np.float32)
        await backend.write("mv", arr.data)  # a memoryview of the array
        await backend.write("ba", bytearray(b"xyz"))
        assert await backend.read("mv") == arr.tobytes()
        assert await backend.read("ba") == b"xyz"

    async def test_write_gather_is_the_parts_one_after_another(self, backend: Backend) -> None:
        rng = np.random.default_rng(0)
        sizes = [0, 1, 4095, 4096, 4097, 3 * MiB + 5, 0, 123, 2 * MiB]
        parts: list[bytes | bytearray | memoryview] = [rng.bytes(n) for n in sizes]
        parts[3] = bytearray(parts[3])
        parts[5] = np.frombuffer(parts[5], np.uint8).data  # a numpy array's memoryview
        await backend.write_gather("gathered/blob", parts)
        assert await backend.read("gathered/blob") == b"".join(parts)
        await backend.write_gather("gathered/none", [])
        assert await backend.read("gathered/none") == b""

    # ---- byte ranges ----

    @pytest.mark.parametrize(
        ("start", "end"),
        [(0, 10), (5, None), (None, 7), (100, 250), (990, 2000), (1000, None), (3, 3)],
    )
    async def test_byte_ranges(self, backend: Backend, start: int | None, end: int | None) -> None:
        data = bytes(range(256)) * 4  # 1024 bytes
        await backend.write("ranged", data)
        assert await backend.read("ranged", start, end) == data[start:end]

    async def test_negative_range_rejected(self, backend: Backend) -> None:
        await backend.write("ranged", b"abc")
        with pytest.raises(ValueError):
            await backend.read("ranged", -1, None)

    async def test_read_into_one_buffer_and_several(self, backend: Backend) -> None:
        data = bytes(range(256)) * 8  # 2048 bytes
        await backend.write("into", data)
        one = bytearray(100)
        await backend.read_into("into", 7, memoryview(one))
        assert bytes(one) == data[7:107]
        sizes = [0, 1, 300, 5, 1200]  # consecutive pieces, an empty one among them
        parts = [np.zeros(n, np.uint8) for n in sizes]
        await backend.read_into("into", 40, [p.data for p in parts])
        assert b"".join(p.tobytes() for p in parts) == data[40 : 40 + sum(sizes)]

    async def test_read_into_past_the_end_is_a_short_read(self, backend: Backend) -> None:
        await backend.write("short", b"0123456789")
        with pytest.raises(ShortReadError, match="short"):
            await backend.read_into("short", 4, [memoryview(bytearray(4))] * 2)
        with pytest.raises(NotFoundError):
            await backend.read_into("missing", 0, memoryview(bytearray(1)))

    # ---- missing objects ----

    async def test_read_missing(self, backend: Backend) -> None:
        with pytest.raises(NotFoundError) as info:
            await backend.read("no/such/key")
        assert "no/such/key" in str(info.value)
        assert backend.url.split("://")[0] in str(info.value)

    async def test_stat_and_exists_missing(self, backend: Backend) -> None:
        with pytest.raises(NotFoundError):
            await backend.stat("missing")
        assert not await backend.exists("missing")
        await backend.write("present", b"1")
        assert await backend.exists("present")

    async def test_stat_of_prefix_is_not_found(self, backend: Backend) -> None:
        await backend.write("dir/file", b"1")
        with pytest.raises(NotFoundError):
            await backend.stat("dir")

    # ---- listing ----

    async def test_list_nested(self, backend: Backend) -> None:
        for key in ["a/1", "a/b/2", "a/b/c/3", "ab/4", "z"]:
            await backend.write(key, key.encode())
        assert await keys_of(backend) == ["a/1", "a/b/2", "a/b/c/3", "ab/4", "z"]
        assert await keys_of(backend, "a") == ["a/1", "a/b/2", "a/b/c/3"]
        assert await keys_of(backend, "a/") == ["a/1", "a/b/2", "a/b/c/3"]
        assert await keys_of(backend, "a/b") == ["a/b/2", "a/b/c/3"]
        assert await keys_of(backend, "nothing") == []
        sizes = {info.key: info.size async for info in backend.list("a")}
        assert sizes == {"a/1": 3, "a/b/2": 5, "a/b/c/3": 7}

    async def test_list_dir(self, backend: Backend) -> None:
        for key in ["a/1", "a/b/2", "a/b/c/3", "ab/4", "z"]:
            await backend.write(key, b"x")
        assert await backend.list_dir() == ["a", "ab", "z"]
        assert await backend.list_dir("a") == ["1", "b"]
        assert await backend.list_dir("missing") == []

    async def test_list_paginates_past_1000(self, backend: Backend) -> None:
        keys = [f"many/{i:05d}" for i in range(1100)]
        await asyncio.gather(*(backend.write(k, b"v") for k in keys))
        assert await keys_of(backend, "many") == keys
        assert len(await backend.list_dir("many")) == 1100

    async def test_invalid_prefix_rejected(self, backend: Backend) -> None:
        with pytest.raises(InvalidKeyError):
            await keys_of(backend, "../up")

    # ---- delete ----

    async def test_delete(self, backend: Backend) -> None:
        await backend.write("d/1", b"1")
        await backend.write("d/2", b"2")
        await backend.delete("d/1")
        assert await keys_of(backend) == ["d/2"]
        await backend.delete("d/1")  # deleting a missing key is fine

    async def test_delete_prefix(self, backend: Backend) -> None:
        for key in ["p/1", "p/q/2", "p/q/r/3", "pq/4", "other"]:
            await backend.write(key, b"x")
        assert await backend.delete_prefix("p") == 3
        assert await keys_of(backend) == ["other", "pq/4"]
        assert await backend.delete_prefix("p") == 0

    async def test_delete_prefix_refuses_root(self, backend: Backend) -> None:
        await backend.write("keep", b"x")
        with pytest.raises(ValueError):
            await backend.delete_prefix("")
        assert await backend.read("keep") == b"x"

    async def test_prune_dirs_never_removes_an_object(self, backend: Backend) -> None:
        await backend.write("s/a/b/1", b"1")
        await supports.prune_dirs(backend, "s/a/b")  # holds an object: nothing goes
        assert await backend.read("s/a/b/1") == b"1"
        await backend.delete("s/a/b/1")
        await supports.prune_dirs(backend, "s/a/b")  # empty now: may go (an optional hook)
        await supports.prune_dirs(backend, "s/gone")  # never existed: fine
        assert await keys_of(backend) == []
        await backend.write("s/a/b/2", b"2")  # writes below a pruned directory still work
        assert await backend.read("s/a/b/2") == b"2"

    # ---- create (the commit primitive) ----

    async def test_create_new_then_exists(self, backend: Backend) -> None:
        await backend.create("marker", b"first")
        with pytest.raises(AlreadyExistsError) as info:
            await backend.create("marker", b"second")
        assert "marker" in str(info.value)
        assert await backend.read("marker") == b"first"

    async def test_create_over_written_object(self, backend: Backend) -> None:
        await backend.write("obj", b"data")
        with pytest.raises(AlreadyExistsError):
            await backend.create("obj", b"other")
        assert await backend.read("obj") == b"data"

    async def test_concurrent_creators_one_wins(self, backend: Backend) -> None:
        if self.concurrent_create_xfail:
            pytest.xfail(self.concurrent_create_xfail)
        n = 12
        results = await asyncio.gather(
            *(backend.create("race", f"writer-{i}".encode()) for i in range(n)),
            return_exceptions=True,
        )
        winners = [i for i, r in enumerate(results) if r is None]
        losers = [r for r in results if isinstance(r, AlreadyExistsError)]
        assert len(winners) == 1, results
        assert len(losers) == n - 1, results
        assert await backend.read("race") == f"writer-{winners[0]}".encode()

    # ---- invalid keys ----

    @pytest.mark.parametrize("key", INVALID_KEYS)
    async def test_invalid_keys_rejected_before_io(self, backend: Backend, key: str) -> None:
        for op in (
            backend.write(key, b"x"),
            backend.create(key, b"x"),
            backend.read(key),
            backend.stat(key),
            backend.delete(key),
        ):
            with pytest.raises(InvalidKeyError):
                await op
        assert await keys_of(backend) == []

    # ---- TensorStore sees the same bytes ----

    async def test_tensorstore_reads_bytes_written(self, backend: Backend) -> None:
        await backend.write("ts/sub/key", b"from the byte api")
        kv = await ts.KvStore.open(backend.kvstore_spec("ts"), context=backend.ts_context)
        assert (await kv.read("sub/key")).value == b"from the byte api"

    async def test_bytes_read_what_tensorstore_wrote(self, backend: Backend) -> None:
        data = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        arr = await ts.open(
            {
                "driver": "zarr3",
                "kvstore": backend.kvstore_spec("arrays/x"),
                "metadata": {
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [32, 32]}}
                },
            },
            create=True,
            dtype=ts.float32,
            shape=data.shape,
            context=backend.ts_context,
        )
        await arr.write(data)
        keys = await keys_of(backend, "arrays/x")
        assert "arrays/x/zarr.json" in keys
        assert len([k for k in keys if k.startswith("arrays/x/c/")]) == 4
        assert b'"zarr_format"' in await backend.read("arrays/x/zarr.json")
        reopened = await ts.open(
            {"driver": "zarr3", "kvstore": backend.kvstore_spec("arrays/x")},
            context=backend.ts_context,
        )
        np.testing.assert_array_equal(await reopened.read(), data)

    # ---- retries through the fault wrapper ----

    async def test_transient_faults_are_retried(self, backend: Backend) -> None:
        policy = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.01)
        faulty = FaultyBackend(backend, fail_on={1, 2, 5}, retry=policy)
        await faulty.write("retried", b"payload")  # calls 1, 2 fail; 3 succeeds
        assert await faulty.read("retried") == b"payload"  # call 4
        assert (await faulty.stat("retried")).size == 7  # call 5 fails, 6 succeeds
        assert faulty.injected == 3

    async def test_lost_create_reply_is_recognised(self, backend: Backend) -> None:
        policy = RetryPolicy(max_attempts=3, base_delay=0.001)
        faulty = FaultyBackend(backend, fail_on={1}, after=True, ops={"create"}, retry=policy)
        await faulty.create("commit", b"token-123")  # landed, reply lost, retry sees own bytes
        assert await backend.read("commit") == b"token-123"
        with pytest.raises(AlreadyExistsError):
            await faulty.create("commit", b"someone else")

    async def test_retries_exhausted(self, backend: Backend) -> None:
        policy = RetryPolicy(max_attempts=3, base_delay=0.001)
        faulty = FaultyBackend(backend, fail_rate=1.0, ops={"write"}, retry=policy)
        with pytest.raises(RetriesExhaustedError):
            await faulty.write("never", b"x")
        assert faulty.calls == 3

    async def test_permanent_faults_are_not_retried(self, backend: Backend) -> None:
        policy = RetryPolicy(max_attempts=5, base_delay=0.001)
        faulty = FaultyBackend(backend, fail_on={1}, error="permanent", retry=policy)
        with pytest.raises(InjectedPermanentFault):
            await faulty.write("k", b"x")
        assert faulty.calls == 1
        assert not await backend.exists("k")
