"""Corruption is caught on restore; a killed writer never leaves a committed step."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.protocol import fates
from tests.paths import attempts, committed_root


async def largest_data_file(backend: Backend, step: int) -> str:
    """The largest file of process 0's store: a data file, or a pack of small leaves."""
    root = await committed_root(backend, step)
    files = [info async for info in backend.list(f"{root}/state/ocdbt.process_0")]
    return max(files, key=lambda info: info.size).key


async def test_flipped_byte_is_caught(any_backend: Backend) -> None:
    big = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    await ckptstore.save(any_backend, {"big": big, "small": np.arange(3)}, step=1)
    key = await largest_data_file(any_backend, 1)
    data = bytearray(await any_backend.read(key))
    data[len(data) // 2] ^= 0x40
    await any_backend.write(key, bytes(data))
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        await ckptstore.restore(any_backend)
    assert info.value.leaf == "big"


async def test_truncated_file_is_caught(any_backend: Backend) -> None:
    big = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    await ckptstore.save(any_backend, {"big": big}, step=1)
    key = await largest_data_file(any_backend, 1)
    data = await any_backend.read(key)
    await any_backend.write(key, data[: len(data) // 3])
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        await ckptstore.restore(any_backend)
    assert info.value.leaf == "big"


async def test_corrupt_manifest_is_reported(any_backend: Backend) -> None:
    await ckptstore.save(any_backend, {"x": np.arange(3)}, step=1)
    await any_backend.write(f"{await committed_root(any_backend, 1)}/manifest.json", b"{not json")
    with pytest.raises(ckptstore.CorruptCheckpointError, match="manifest"):
        await ckptstore.restore(any_backend)


KILL_BEFORE_MARKER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import numpy as np
    import ckptstore
    from ckptstore.backends.local import LocalBackend

    class DiesBeforeCommit(LocalBackend):
        async def _create(self, key, data):
            if key.endswith("COMMITTED"):
                os.kill(os.getpid(), signal.SIGKILL)
            return await super()._create(key, data)

    tree = {"x": np.arange(1000) + 2, "y": np.ones((64, 64))}
    asyncio.run(ckptstore.save(DiesBeforeCommit(sys.argv[1]), tree, step=2))
    """
)

KILL_AT_POINT = textwrap.dedent(
    """
    import asyncio, sys, time
    import numpy as np
    import ckptstore
    import ckptstore.checkpoint.saveplan as saveplan_module
    import ckptstore.datapath.arrays as arrays_module
    from tests.campaigns.killpoints import first_bytes

    point = sys.argv[2]
    real_write, real_merge = arrays_module.write_leaves, saveplan_module.merge

    async def write_leaves(*args, **kwargs):
        task = asyncio.ensure_future(real_write(*args, **kwargs))
        if point == "writing":
            await first_bytes(*args)
            print("at point", flush=True)
            time.sleep(60)  # blocks the loop: killed here, mid-write
        return await task

    async def merge(*args, **kwargs):
        result = await real_merge(*args, **kwargs)
        if point == "merged":
            print("at point", flush=True)
            time.sleep(60)  # killed after the merge committed, before the manifest
        return result

    arrays_module.write_leaves, saveplan_module.merge = write_leaves, merge
    tree = {f"leaf{i}": np.full((512, 1024), i, np.float32) for i in range(64)}
    asyncio.run(ckptstore.save(sys.argv[1], tree, step=2))
    """
)


async def check_only_step_one(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LocalBackend(root)
    assert await ckptstore.list_steps(backend) == [1]
    restored = await ckptstore.restore(backend)
    np.testing.assert_array_equal(restored["x"], np.arange(1000) + 1)
    # The step can be saved again afterwards, in a new attempt; gc collects the dead one.
    (dead,) = await attempts(backend, 2)
    result = await ckptstore.save(backend, {"x": np.arange(4)}, step=2)
    assert await ckptstore.list_steps(backend) == [1, 2] and result.attempt != dead
    # Killed mid-write, the dead attempt may hold only the temporary files of packs being
    # written (invisible to listings): gc then names those. Killed after its commit claim
    # (the merge, the manifest), the attempt is kept for the claim's lifetime: a day on.
    monkeypatch.setattr(fates, "CLAIM_TTL", 0.0)
    entries = (await ckptstore.gc(backend, older_than=0)).entries
    assert entries and all(e == f"2/{dead}" or e.startswith(f"2/{dead}/") for e in entries)
    assert [info async for info in backend.list(f"2/{dead}")] == []
    assert not [p for p in (root / "2" / dead).rglob("*") if p.is_file()]
    np.testing.assert_array_equal((await ckptstore.restore(backend))["x"], np.arange(4))


async def test_writer_killed_before_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    await ckptstore.save(str(root), {"x": np.arange(1000) + 1}, step=1)
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", KILL_BEFORE_MARKER, str(root)], timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    assert list((root / "2").glob("attempt-*/manifest.json"))  # it got as far as the manifest
    assert not (root / "2" / "COMMITTED").exists()
    await check_only_step_one(root, monkeypatch)


@pytest.mark.parametrize("point", ["writing", "merged"])
async def test_writer_killed_mid_save(
    tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    await ckptstore.save(str(root), {"x": np.arange(1000) + 1}, step=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_AT_POINT, str(root), point],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "at point"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert list((root / "2").glob("attempt-*/state/ocdbt.process_0"))  # killed mid-save
    await check_only_step_one(root, monkeypatch)


def test_blocking_twins(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    ckptstore.save_sync(root, {"a": np.arange(3)}, step=4)
    assert ckptstore.list_steps_sync(root) == [4]
    np.testing.assert_array_equal(ckptstore.restore_sync(root)["a"], np.arange(3))


async def test_blocking_twins_inside_a_running_loop(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    ckptstore.save_sync(root, {"a": np.arange(3)}, step=1)
    assert ckptstore.list_steps_sync(root) == [1]


async def test_damage_no_restore_reads_is_told_apart_from_damage_that_changes_one(
    tmp_path: Path,
) -> None:
    """Every leaf of this step is small, so packed: a restore never opens the item's merged
    store. Damage there is reported under ``unused``, and ``ok`` stays true (the restore is
    bit-exact); damage a restore reads still makes ``ok`` false."""
    root = str(tmp_path / "ckpt")
    tree = {"a": np.arange(10, dtype=np.float32), "b": np.ones(3, np.int32)}
    await ckptstore.save(root, tree, step=1)
    attempt = json.loads((tmp_path / "ckpt" / "1" / "COMMITTED").read_text())["attempt"]
    (tmp_path / "ckpt" / "1" / attempt / "state" / "manifest.ocdbt").write_bytes(b"garbage")
    got = await ckptstore.restore(root, step=1)
    assert all(np.array_equal(got[k], tree[k]) for k in tree)
    report = await ckptstore.verify(root, step=1)
    assert report.ok and not report.problems
    assert list(report.unused) == ["state/"] and "no leaf is read" in report.unused["state/"]
    packs = sorted((tmp_path / "ckpt" / "1" / attempt / "state").rglob("pack-*"))
    blob = bytearray(packs[0].read_bytes())
    blob[-3] ^= 0x01  # inside a packed chunk: what a restore reads
    packs[0].write_bytes(bytes(blob))
    assert not (await ckptstore.verify(root, step=1)).ok


@pytest.mark.parametrize("codecs", [None, "zstd:3"])
async def test_verify_is_ok_only_where_a_restore_is_bit_exact_with_checksums_fixed(
    tmp_path: Path, codecs: str | None
) -> None:
    """A chunk changed before its checksum was taken (or edited, its crc32c fixed) passes
    the checksum, raw or inside a zstd frame (whose own checksum is off); the leaf's
    recorded digest does not: `verify` is ok exactly where a restore is bit-exact."""
    from ckptstore.format.chunks import checksum

    backend = ckptstore.open_backend(str(tmp_path / "ckpt"))
    big = (np.arange(256 * 64) % 1000).astype(np.float32).reshape(256, 64)  # 4 chunks
    await ckptstore.save(backend, {"big": big}, step=1, codecs=codecs, chunk_bytes=16 << 10)
    key = await largest_data_file(backend, 1)
    honest = await backend.read(key)
    if codecs is None:  # the second chunk's values, then its crc32c
        start = honest.index(big[64:128].tobytes())
        end = start + big[64:128].nbytes
    else:  # the second zstd frame (magic 28 b5 2f fd), then its crc32c
        frames = [i for i in range(len(honest) - 3) if honest[i : i + 4] == b"\x28\xb5\x2f\xfd"]
        start, end = frames[1], frames[2] - 4
    caught = 0
    for flip in range(start + 4, end, max(1, (end - start) // 24)):
        data = bytearray(honest)
        data[flip] ^= 0x10
        data[end : end + 4] = checksum(np.frombuffer(bytes(data[start:end]), np.uint8))
        await backend.write(key, bytes(data))
        report = await ckptstore.verify(backend, step=1)
        try:
            exact = np.array_equal(np.asarray((await ckptstore.restore(backend))["big"]), big)
        except ckptstore.CorruptCheckpointError:
            exact = False
        assert report.ok == exact, (flip - start, report.problems)
        caught += any("its bytes" in why for why in report.problems.values())
    assert caught  # the digest, not a decoder's error, told these
