"""A device slice larger than the restore's host buffers reaches an accelerator in pieces
(`ckptstore.datapath.placement.Assembly`), never as one host allocation of the whole slice.
CI has no accelerator, so CPU devices are taken for one (`placement.on_host` patched) and the
piece size is made small: the restore then runs as it would there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.datapath import placement
from ckptstore.runtime import hostpool

PIECE = 64 << 10  # bytes: 16 rows of 1024 float32


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """CPU devices count as accelerators, pieces are `PIECE` bytes; records each piece
    placed (its shape) and each host buffer the restore's pool handed out (its size)."""
    seen: dict[str, list[Any]] = {"pieces": [], "taken": []}
    add, take = placement.Assembly.add, hostpool.HostPool.take

    async def counted_add(self: placement.Assembly, start: int, data: np.ndarray) -> None:
        seen["pieces"].append((start, data.shape))
        await add(self, start, data)

    def counted_take(self: hostpool.HostPool, nbytes: int) -> np.ndarray:
        seen["taken"].append(nbytes)
        return take(self, nbytes)

    monkeypatch.setattr(placement, "on_host", lambda devices: False)
    monkeypatch.setattr(placement, "PIECE_BYTES", PIECE)
    monkeypatch.setattr(placement.Assembly, "add", counted_add)
    monkeypatch.setattr(hostpool.HostPool, "take", counted_take)
    return seen


def _save(tmp_path: Path, tree: dict[str, Any]) -> str:
    path = str(tmp_path / "ckpt")
    ckptstore.save_sync(path, tree, step=1, chunk_bytes=32 << 10)  # chunks of 8 rows
    return path


def _like(tree: dict[str, Any], shardings: dict[str, Any]) -> dict[str, Any]:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in tree.items()
    }


def test_plan_splits_only_what_is_larger_than_a_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "PIECE_BYTES", PIECE)
    assert placement.piece_plan((16, 1024), 4, (8, 1024)) is None  # one piece's worth
    assert placement.piece_plan((100, 1024), 4, (8, 1024)) == (0, 16)  # whole chunks
    assert placement.piece_plan((100, 1024), 4, (5, 1024)) == (0, 15)
    assert placement.piece_plan((1, 100, 1024), 4, (1, 8, 1024)) == (1, 16)  # first axis > 1
    assert placement.piece_plan((3, 65536), 4, (3, 65536)) == (0, 1)  # a row is a piece
    assert placement.piece_starts(100, 16) == [0, 16, 32, 48, 64, 80, 84]
    assert placement.piece_starts(32, 16) == [0, 16]


def test_a_large_slice_is_restored_in_pieces_bit_exact(
    tmp_path: Path, accelerator: dict[str, list[Any]]
) -> None:
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((100, 1024), dtype=np.float32)}  # 400 KiB: 7 pieces
    path = _save(tmp_path, tree)
    device = jax.devices()[0]
    like = _like(tree, {"w": jax.sharding.SingleDeviceSharding(device)})
    got = ckptstore.restore_sync(path, 1, like)
    assert got["w"].sharding == like["w"].sharding
    np.testing.assert_array_equal(np.asarray(got["w"]), tree["w"])
    starts = sorted(start for start, _ in accelerator["pieces"])
    assert starts == [0, 16, 32, 48, 64, 80, 84]  # the last overlaps: every piece one shape
    assert {shape for _, shape in accelerator["pieces"]} == {(16, 1024)}
    # No host buffer of the whole slice: at most a piece's worth at a time.
    assert accelerator["taken"] and max(accelerator["taken"]) <= PIECE


def test_sharded_replicated_and_cast_leaves_in_pieces(
    tmp_path: Path, accelerator: dict[str, list[Any]]
) -> None:
    rng = np.random.default_rng(1)
    tree = {
        "rows": rng.standard_normal((200, 1024), dtype=np.float32),  # 4 slices of 50 rows
        "cols": rng.standard_normal((72, 2048), dtype=np.float32),  # split along axis 1
        "whole": rng.standard_normal((40, 1024), dtype=np.float32),  # replicated
        "half": rng.standard_normal((80, 1024), dtype=np.float32).astype(ml_dtypes.bfloat16),
    }
    path = _save(tmp_path, tree)
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    shardings = {
        "rows": NamedSharding(mesh, P("d", None)),
        "cols": NamedSharding(mesh, P(None, "d")),
        "whole": NamedSharding(mesh, P()),
        "half": NamedSharding(mesh, P("d", None)),
    }
    like = _like(tree, shardings)
    like["half"] = jax.ShapeDtypeStruct((80, 1024), np.float32, sharding=shardings["half"])
    got = ckptstore.restore_sync(path, 1, like, cast=True)
    for name, value in tree.items():
        assert got[name].sharding == shardings[name], name
        want = value.astype(np.float32) if name == "half" else value
        np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)
    assert got["half"].dtype == np.float32
    # Pieces of at most 64 KiB, the last of each slice overlapping the one before:
    # rows: 4 slices of 50 x 1024 (starts 0, 16, 32, 34); cols: 4 of 72 x 512 (0, 32, 40);
    # whole: one slice for its 4 devices (0, 16, 24); half, as float32: 4 of 20 x 1024 (0, 4).
    assert len(accelerator["pieces"]) == 4 * 4 + 4 * 3 + 3 + 4 * 2
    assert max(accelerator["taken"]) <= PIECE


def test_small_leaves_and_host_devices_take_the_usual_path(tmp_path: Path) -> None:
    tree = {"w": np.arange(100 * 1024, dtype=np.float32).reshape(100, 1024)}
    path = _save(tmp_path, tree)
    like = _like(tree, {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])})
    calls: list[int] = []
    real = placement.Assembly.add

    async def add(self: placement.Assembly, start: int, data: np.ndarray) -> None:
        calls.append(start)
        await real(self, start, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement, "PIECE_BYTES", PIECE)
        mp.setattr(placement.Assembly, "add", add)
        got = ckptstore.restore_sync(path, 1, like)  # CPU devices adopt host buffers: no split
    np.testing.assert_array_equal(np.asarray(got["w"]), tree["w"])
    assert calls == []
