"""Incremental saves (``save(..., base=B)``): only changed leaves are written, reads follow
the references, and deletion and gc keep what a committed step references
(docs/incremental.md)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore import api
from ckptstore.backends.base import Backend
from ckptstore.errors import (
    BaseStepGoneError,
    CorruptCheckpointError,
)
from ckptstore.format import layout
from ckptstore.format.digests import ALGORITHM, LEGACY, digest
from ckptstore.format.manifest import Manifest, Reference
from ckptstore.format.packs import entry_size
from ckptstore.protocol import load_committed
from tests.checkpoint.helpers import FROZEN, assert_same, holders, lora, stored_bytes
from tests.conftest import make_backend
from tests.paths import committed_root


@pytest.fixture(params=["local", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b = await make_backend(request.param, request, tmp_path)
    async with b:
        yield b


async def test_only_changed_leaves_are_written_and_restore_bit_exact(backend: Backend) -> None:
    full = await ckptstore.save(backend, lora(1), step=1)
    inc = await ckptstore.save(backend, lora(2), step=2, base=1)
    changed = 64 * 16 * 4 * 2 + 8  # the adapters and the step counter
    assert full.bytes_written == full.bytes and full.bytes_referenced == 0
    assert inc.bytes_written == changed
    assert inc.bytes_referenced == FROZEN.nbytes + 7 * 4
    # On storage: step 2's attempt holds the changed leaves and their metadata only.
    assert await stored_bytes(backend, 2) < changed + (64 << 10)
    assert await stored_bytes(backend, 1) > FROZEN.nbytes

    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert_same(await ckptstore.restore(backend, 1), lora(1))
    assert (await ckptstore.verify(backend, 2)).ok

    # Step 3 on base 2 references the original holder (step 1), never step 2: no chains.
    await ckptstore.save(backend, lora(3), step=3, base=2)
    step1 = (1, str((await load_committed(backend, 1)).attempt))
    assert await holders(backend, 3) == {step1} == await holders(backend, 2)
    assert_same(await ckptstore.restore(backend, 3), lora(3))
    manifest = await load_committed(backend, 3)
    assert manifest.format_version == 4 and manifest.base is not None
    assert manifest.base == Reference(2, str((await load_committed(backend, 2)).attempt))
    assert manifest.references == [Reference(*step1)]
    # Written as read: the references and base are {"step", "attempt"} objects on disk.
    raw = await backend.read(f"{await committed_root(backend, 3)}/manifest.json")
    assert Manifest.from_bytes(raw, where="step 3").to_bytes() == raw
    assert json.loads(raw)["references"] == [{"step": 1, "attempt": step1[1]}]
    assert set(manifest.items["state"].refs) == {"base/w", "base/norm"}
    # A step without references stays format version 3 (what older readers read).
    assert (await load_committed(backend, 1)).format_version == 3


async def test_partial_restore_of_referenced_leaves(backend: Backend) -> None:
    await ckptstore.save(backend, lora(1), step=1)
    await ckptstore.save(backend, lora(2), step=2, base=1)
    like = {"base": {"w": jax.ShapeDtypeStruct(FROZEN.shape, FROZEN.dtype)}}
    got = await ckptstore.restore(backend, 2, like, partial=True)
    np.testing.assert_array_equal(np.asarray(got["base"]["w"]), FROZEN)


async def test_a_leaf_changed_in_form_or_content_is_written(backend: Backend) -> None:
    tree = {
        "same": np.arange(1000, dtype=np.int32),
        "reshaped": np.arange(1000, dtype=np.int32),
        "retyped": np.arange(1000, dtype=np.int32),
        "one_element": np.arange(1000, dtype=np.int32),
        "gone": np.ones(3),
    }
    await ckptstore.save(backend, tree, step=1)
    later = {
        "same": tree["same"],
        "reshaped": tree["reshaped"].reshape(10, 100),  # the same bytes, another shape
        "retyped": tree["retyped"].view(np.float32),  # the same bytes, another dtype
        "one_element": tree["one_element"].copy(),
        "new": np.zeros(5),
    }
    later["one_element"][999] += 1
    result = await ckptstore.save(backend, later, step=2, base=1)
    assert result.bytes_referenced == 4000
    assert result.bytes_written == 3 * 4000 + 40
    assert set((await load_committed(backend, 2)).items["state"].refs) == {"same"}
    assert_same(await ckptstore.restore(backend, 2), later)


async def test_base_deleted_with_later_steps_alive_then_gc_frees_it(backend: Backend) -> None:
    for k in (1, 2, 3):
        await ckptstore.save(backend, lora(k), step=k, base=k - 1 if k > 1 else None)
    base_root = await committed_root(backend, 1)

    async def base_objects() -> int:
        return len([o async for o in backend.list(base_root)])

    kept = await base_objects()
    await ckptstore.delete_step(backend, 1)
    assert await ckptstore.list_steps(backend) == [2, 3]
    assert await base_objects() == kept + 1  # its DELETED record added; no byte removed
    await ckptstore.gc(backend, older_than=0)  # grace 0: still referenced by 2 and 3
    assert await base_objects() == kept + 1
    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert (await ckptstore.verify(backend, 3)).ok

    await ckptstore.delete_step(backend, 2)
    await ckptstore.gc(backend, older_than=0)
    assert await base_objects() == kept + 1  # step 3 still references it
    assert_same(await ckptstore.restore(backend, 3), lora(3))

    await ckptstore.delete_step(backend, 3)  # the last referrer
    assert await base_objects() == kept + 1  # delete_step removes its own attempt only
    removed = await ckptstore.gc(backend, older_than=0)
    assert base_root in removed.entries
    left = [o.key.rsplit("/", 1)[1] async for o in backend.list(base_root)]
    assert set(left) <= set(layout.TOMBSTONES)  # the tombstone, until gc removes it a day later


async def test_a_corrupted_base_byte_is_caught_by_the_referencing_step(backend: Backend) -> None:
    await ckptstore.save(backend, lora(1), step=1)
    await ckptstore.save(backend, lora(2), step=2, base=1)
    base_root = await committed_root(backend, 1)
    files = [o async for o in backend.list(base_root) if "/ocdbt.process_0/d/" in o.key]
    assert files, [o.key async for o in backend.list(base_root)]
    biggest = max(files, key=lambda o: o.size)
    data = bytearray(await backend.read(biggest.key))
    data[len(data) // 2] ^= 0x01
    await backend.write(biggest.key, bytes(data))

    report = await ckptstore.verify(backend, 2)
    assert not report.ok
    assert any(key.endswith("base/w") for key in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError):
        await ckptstore.restore(backend, 2)


async def test_a_damaged_base_pack_is_caught_by_the_referencing_step(backend: Backend) -> None:
    await ckptstore.save(backend, lora(1), step=1)
    await ckptstore.save(backend, lora(2), step=2, base=1)
    manifest = await load_committed(backend, 2)
    ref = manifest.items["state"].packed["base/norm"]  # a small leaf: in step 1's pack
    key = f"{await committed_root(backend, 1)}/state/{ref.key}"
    info = manifest.items["state"].leaves["base/norm"]
    data = bytearray(await backend.read(key))
    data[ref.offset + entry_size(info) - 6] ^= 0x10  # its data's last bytes
    await backend.write(key, bytes(data))
    report = await ckptstore.verify(backend, 2)
    assert not report.ok and any(k.endswith("base/norm") for k in report.problems)
    with pytest.raises(CorruptCheckpointError):
        await ckptstore.restore(backend, 2)


async def test_several_items(backend: Backend) -> None:
    items = {"model": lora(1)["base"], "opt": {"m": np.ones(100)}}
    await api.save_items(backend, items, step=1)
    later = {"model": items["model"], "opt": {"m": np.zeros(100)}, "extra": {"x": np.ones(2)}}
    result = await api.save_items(backend, later, step=2, base=1)
    assert result.bytes_written == 800 + 16
    manifest = await load_committed(backend, 2)
    assert set(manifest.items["model"].refs) == {"w", "norm"} and not manifest.items["opt"].refs
    for name, tree in later.items():
        assert_same(await ckptstore.restore(backend, 2, item=name), tree)
    assert (await ckptstore.verify(backend, 2)).ok


async def test_a_missing_base_is_typed_and_nothing_is_written(backend: Backend) -> None:
    with pytest.raises(BaseStepGoneError):
        await ckptstore.save(backend, lora(1), step=1, base=7)
    assert [o async for o in backend.list("1")] == []


async def test_base_deleted_before_the_commit_fails_typed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base goes after the save read it and before its manifest: the deletion finds no
    reference (the manifest is not written yet) and removes the base's bytes; the commit's
    re-check sees the base gone, and the save fails typed, committing nothing."""
    await ckptstore.save(backend, lora(1), step=1)
    write = backend.write

    async def deleting_first(key: str, data: bytes) -> None:
        if key.startswith("2/") and key.endswith(layout.MANIFEST):
            await ckptstore.delete_step(backend, 1)
        await write(key, data)

    monkeypatch.setattr(backend, "write", deleting_first)
    with pytest.raises(BaseStepGoneError):
        await ckptstore.save(backend, lora(2), step=2, base=1)
    assert await ckptstore.list_steps(backend) == []


async def test_base_deleted_after_the_check_is_kept(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base goes after the commit's re-check and before the marker: the deletion finds
    the referencing manifest (a save in flight) and keeps the base's bytes."""
    await ckptstore.save(backend, lora(1), step=1)
    create = backend.create

    async def deleting_first(key: str, data: bytes) -> None:
        if key == layout.commit_key(2):
            await ckptstore.delete_step(backend, 1)
            await ckptstore.gc(backend, older_than=0)
        await create(key, data)

    monkeypatch.setattr(backend, "create", deleting_first)
    await ckptstore.save(backend, lora(2), step=2, base=1)
    assert await ckptstore.list_steps(backend) == [2]
    assert_same(await ckptstore.restore(backend, 2), lora(2))
    assert (await ckptstore.verify(backend, 2)).ok


def mesh(shape: tuple[int, int], names: tuple[str, str] = ("x", "y")) -> Mesh:
    devices = np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return Mesh(devices, names)


async def test_sharded_leaves_referenced_and_restored_onto_another_mesh(backend: Backend) -> None:
    if len(jax.devices()) < 8:
        pytest.fail(f"need 8 CPU devices (XLA_FLAGS), have {len(jax.devices())}")
    m = mesh((4, 2))
    data = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    frozen = jax.device_put(data, NamedSharding(m, P("x", "y")))
    tree = {"frozen": frozen, "resharded": frozen, "lr": jax.device_put(np.float32(1e-3))}
    await ckptstore.save(backend, tree, step=1)
    later = {
        "frozen": frozen,
        # The same content laid out in other pieces: written again (its layout changed).
        "resharded": jax.device_put(data, NamedSharding(m, P("y", "x"))),
        "lr": jax.device_put(np.float32(2e-3)),
    }
    result = await ckptstore.save(backend, later, step=2, base=1)
    assert result.bytes_referenced == data.nbytes
    assert result.bytes_written == data.nbytes + 4

    other = mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(other, P("b", "a"))
    like = {
        "frozen": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding),
        "resharded": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding),
        "lr": jax.ShapeDtypeStruct((), np.float32),
    }
    got = await ckptstore.restore(backend, 2, like)
    assert got["frozen"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(got["frozen"]), data)
    np.testing.assert_array_equal(np.asarray(got["resharded"]), data)
    assert float(got["lr"]) == np.float32(2e-3)


async def _rewrite_manifest(backend: Backend, step: int, edit: Any) -> None:
    """Rewrite committed ``step``'s manifest with ``edit(item)`` applied to each item, as
    an earlier version would have written it (and its commit marker to match)."""
    from ckptstore.protocol import digest

    root = await committed_root(backend, step)
    manifest_key = f"{root}/{layout.MANIFEST}"
    doc = json.loads(await backend.read(manifest_key))
    for item in doc["items"].values():
        edit(item)
    data = json.dumps(doc).encode()
    await backend.write(manifest_key, data)
    marker = json.loads(await backend.read(layout.commit_key(step)))
    marker["manifest_digest"] = digest(data)
    await backend.write(layout.commit_key(step), json.dumps(marker).encode())


async def test_a_step_saved_without_digests_is_a_base_for_nothing(backend: Backend) -> None:
    """Steps written before digests were recorded restore as ever, and as a base they
    reference nothing: every leaf is written."""
    await ckptstore.save(backend, lora(1), step=1)

    def no_digests(item: dict[str, Any]) -> None:
        item.pop("digests")
        item.pop("digest")

    await _rewrite_manifest(backend, 1, no_digests)
    assert_same(await ckptstore.restore(backend, 1), lora(1))
    result = await ckptstore.save(backend, lora(1), step=2, base=1)
    assert result.bytes_referenced == 0 and result.bytes_written == result.bytes
    assert not (await load_committed(backend, 2)).references


async def test_digests_of_another_algorithm_are_never_compared(backend: Backend) -> None:
    """A step whose digests an earlier version recorded (BLAKE2b, no ``digest`` field)
    restores as ever but references nothing as a base, although its digests are valid
    hex: the next save writes every leaf and records BLAKE3, which the one after uses."""
    await ckptstore.save(backend, lora(1), step=1)
    legacy = {}

    def as_blake2b(item: dict[str, Any]) -> None:
        assert item.pop("digest") == ALGORITHM == "blake3-128-chunks"
        legacy.update(item["digests"])

    await _rewrite_manifest(backend, 1, as_blake2b)
    manifest = await ckptstore.read_manifest(backend, 1)
    assert manifest.items["state"].digest_algorithm == LEGACY
    assert manifest.items["state"].digests == legacy  # parsed, kept, not used

    assert_same(await ckptstore.restore(backend, 1), lora(1))
    second = await ckptstore.save(backend, lora(1), step=2, base=1)
    assert second.bytes_referenced == 0 and second.bytes_written == second.bytes
    assert (await ckptstore.read_manifest(backend, 2)).items["state"].digest_algorithm == ALGORITHM
    third = await ckptstore.save(backend, lora(1), step=3, base=2)
    assert (
        third.bytes_referenced > 0 and third.bytes_referenced == third.bytes - third.bytes_written
    )


def test_the_digest_is_blake3_of_the_little_endian_bytes() -> None:
    """The documented algorithm, over the documented bytes (C order, little-endian)."""
    import blake3

    data = np.arange(12, dtype=">f4").reshape(3, 4)[:, 1:3]  # big-endian, not contiguous
    want = blake3.blake3(np.ascontiguousarray(data, dtype="<f4").tobytes()).hexdigest(16)
    assert digest(data) == want
    assert digest(data.astype("<f4")) == want


async def test_verify_compares_referenced_bytes_with_their_recorded_digests(
    tmp_path: Path,
) -> None:
    """A forged (re-signed) manifest whose reference points at another attempt of the same
    shape, or whose recorded digest is false: a restore would return other values, and
    `verify` says so instead of "intact"."""
    from tests.checkpoint.helpers import resign

    backend = ckptstore.open_backend(str(tmp_path / "ckpt"))
    other = {**lora(3), "base": {"w": FROZEN + 1, "norm": np.linspace(1, 2, 7, dtype=np.float32)}}
    await ckptstore.save(backend, lora(1), step=1)
    await ckptstore.save(backend, lora(2), step=2, base=1)
    third = await ckptstore.save(backend, other, step=3)
    assert (await ckptstore.verify(backend, step=2)).ok
    honest = await backend.read(f"{await committed_root(backend, 2)}/manifest.json")

    doc = json.loads(honest)
    doc["references"] = [{"step": 3, "attempt": third.attempt}]  # same shapes, other bytes
    await resign(backend, 2, json.dumps(doc).encode())
    report = await ckptstore.verify(backend, step=2)
    assert not report.ok
    assert any("not the ones its save recorded" in why for why in report.problems.values())

    doc = json.loads(honest)
    table = doc["items"]["state"]["digests"]["base/w"]
    table[next(iter(table))] = "0" * 32  # a false digest for bytes step 1 does hold
    await resign(backend, 2, json.dumps(doc).encode())
    assert not (await ckptstore.verify(backend, step=2)).ok
    await resign(backend, 2, honest)
    assert (await ckptstore.verify(backend, step=2)).ok
