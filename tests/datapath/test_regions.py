"""Regions of a piece read without the whole piece (`ckptstore.datapath.regions`): views
of host data, device slices of an accelerator's. CI has no accelerator, so a CPU jax array
is taken for one (`on_accelerator` patched): the slices then run as they would there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.datapath import regions
from ckptstore.datapath.regions import read_regions

ROWS, COLS = 512, 64  # float32, chunks of 32 x 32 (4 KiB): two per band of 32 rows


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every CPU jax array counts as on an accelerator; the shape of each region copied
    from one is recorded."""
    shapes: list[tuple[int, ...]] = []
    real = regions._gather

    def gather(data: jax.Array, starts: Any, size: tuple[int, ...]) -> list[Any]:
        out = real(data, starts, size)
        shapes.extend(part.shape for part in out)
        return out

    monkeypatch.setattr(regions, "on_accelerator", lambda data: True)
    monkeypatch.setattr(regions, "_gather", gather)
    return shapes


def test_host_data_is_read_in_place() -> None:
    host = np.arange(64.0).reshape(8, 8)
    [part] = read_regions(host, [(slice(2, 4), slice(0, 8))])
    assert np.shares_memory(part, host) and part.shape == (2, 8)
    on_cpu = jnp.arange(64.0).reshape(8, 8)
    assert not regions.on_accelerator(on_cpu)
    [part] = read_regions(on_cpu, [(slice(1, 3), slice(4, 6))])
    np.testing.assert_array_equal(part, host[1:3, 4:6])


def test_device_regions_are_sliced_on_the_device(fetched: list[tuple[int, ...]]) -> None:
    values = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
    wanted = [
        (slice(32, 64), slice(0, 64)),
        (slice(480, 512), slice(32, 64)),
        (slice(0, 32), slice(None)),
        (slice(64, 96), slice(0, 32)),
        (slice(96, 128), slice(0, 32)),
    ]
    for region, part in zip(wanted, read_regions(jnp.asarray(values), wanted), strict=True):
        np.testing.assert_array_equal(part, values[region])
    assert fetched == [(32, 64), (32, 64), (32, 32), (32, 32), (32, 32)]  # one call per shape


def test_a_declared_save_of_device_arrays_copies_only_declared_bands(
    tmp_path: Path, fetched: list[tuple[int, ...]]
) -> None:
    """Only the declared rows' bands are copied, once: hashed, and the changed chunks
    written from them (3 bands of a 16-band table, where `np.asarray` would copy it all)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = NamedSharding(mesh, P("x", None))
    values = np.random.default_rng(1).standard_normal((ROWS, COLS), dtype=np.float32)
    root = str(tmp_path / "ckpt")
    first = ckptstore.save_sync(
        root, {"t": jax.device_put(values, sharding)}, step=1, chunk_bytes=4096
    )
    rows = [5, 300, 301, 480]  # bands 0, 9 and 15; row 301 declared but not changed
    for r in (5, 300, 480):
        values[r, r % COLS] += 1.0
    fetched.clear()
    second = ckptstore.save_sync(
        root,
        {"t": jax.device_put(values, sharding)},
        step=2,
        base=first,
        changed={"t": rows},
        chunk_bytes=4096,
    )
    assert sorted(fetched) == [(32, 64)] * 3
    assert second.bytes_written == 3 * 32 * 32 * 4
    np.testing.assert_array_equal(ckptstore.restore_sync(root, 2)["t"], values)
    assert ckptstore.verify_sync(root, 2).ok


def test_one_compiled_gather_serves_any_number_of_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions go `BATCH` to a device call: 1, 9 and 20 regions of one shape reuse the
    same compiled gather (no compile per count), each region exact."""
    monkeypatch.setattr(regions, "on_accelerator", lambda data: True)
    values = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    on_device = jnp.asarray(values)
    regions._gatherer.cache_clear()
    for count in (1, 9, 20):
        wanted = [(slice(8 * k, 8 * k + 8), slice(16, 48)) for k in range(count)]
        for region, part in zip(wanted, read_regions(on_device, wanted), strict=True):
            np.testing.assert_array_equal(part, values[region])
    gather = regions._gatherer((8, 32))
    assert regions._gatherer.cache_info().currsize == 1
    assert gather._cache_size() == 1  # compiled once, for BATCH starts
