"""Declared changes: ``save(..., base=, changed={leaf: rows})`` hashes only the chunks holding
the declared rows and takes the base's digests for the rest (docs/incremental.md,
"Declared changes"). What it stores must be what a save that hashes everything stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.api import save_items
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import BaseStepGoneError, ConfigError
from ckptstore.format import layout
from ckptstore.protocol import load_committed
from tests.checkpoint.helpers import assert_same
from tests.conftest import make_backend

ROWS, COLS = 1024, 64  # float32: 256 KiB
CHUNK = 4096  # bytes: chunks of 32 x 32, two per band of 32 rows: 64 chunks
CHUNK_BYTES = 32 * 32 * 4


@pytest.fixture(params=["local", "memory", "s3"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b = await make_backend(request.param, request, tmp_path)
    async with b:
        yield b


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[Backend]:
    b = LocalBackend(tmp_path / "ckpt")
    async with b:
        yield b


def table(seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((ROWS, COLS), dtype=np.float32)


def touched(values: np.ndarray[Any, Any], *rows: int) -> np.ndarray[Any, Any]:
    out = values.copy()
    for row in rows:
        out[row] += 1.0
    return out


def tree(emb: Any, step: int) -> dict[str, Any]:
    return {"emb": emb, "bias": np.arange(8, dtype=np.float32) + step}


async def save(backend: Backend, emb: Any, step: int, **kw: Any) -> ckptstore.SaveResult:
    return await ckptstore.save(backend, tree(emb, step), step=step, chunk_bytes=CHUNK, **kw)


async def test_declared_rows_store_what_hashing_everything_stores(backend: Backend) -> None:
    """Step 2 hashed whole and step 12 declared: the same bytes written, the same chunk
    references and digests, the same values; both verify."""
    first = table()
    r1 = await save(backend, first, 1)
    later = touched(first, 3, 700, 701)  # bands 0 and 21: 4 chunks
    hashed = await save(backend, later, 2, base=1)
    declared = await save(backend, later, 12, base=r1, changed={"emb": [700, 3, 701]})
    assert declared.bytes_written == hashed.bytes_written == 4 * CHUNK_BYTES + 32
    assert declared.bytes_referenced == hashed.bytes_referenced
    two, twelve = [await load_committed(backend, s) for s in (2, 12)]
    a, b = two.items["state"], twelve.items["state"]
    assert b.chunk_refs["emb"].to_json() == a.chunk_refs["emb"].to_json()
    assert b.chunk_digests == a.chunk_digests and b.digests["emb"] == a.digests["emb"]
    assert_same(await ckptstore.restore(backend, 12), tree(later, 12))
    assert (await ckptstore.verify(backend, 12)).ok


@pytest.mark.parametrize("form", ["set", "mask", "jax"])
async def test_rows_as_a_set_a_boolean_mask_or_a_jax_array(local: Backend, form: str) -> None:
    """The forms a training loop has at hand: a set of touched rows, a mask of them, or
    the indices as a jax array, each taken as the list of those rows."""
    first = table()
    r1 = await save(local, first, 1)
    later = touched(first, 3, 700)
    mask = np.zeros(ROWS, bool)
    mask[[3, 700]] = True
    rows = {"set": {700, 3}, "mask": mask, "jax": jax.numpy.array([700, 3])}[form]
    got = await save(local, later, 2, base=r1, changed={"emb": rows})
    assert got.bytes_written == 4 * CHUNK_BYTES + 32
    assert_same((await ckptstore.restore(local, 2))["emb"], later)


async def test_declared_rows_that_did_not_change_are_referenced(local: Backend) -> None:
    """A declared row whose values are the base's is hashed, found equal and referenced."""
    first = table()
    await save(local, first, 1)
    got = await save(local, touched(first, 40), 2, base=1, changed={"emb": [0, 40]})
    assert got.bytes_written == 2 * CHUNK_BYTES + 32  # band 1 only, not band 0
    assert_same((await ckptstore.restore(local, 2))["emb"], touched(first, 40))


async def test_declared_rows_all_unchanged_hold_every_chunk(local: Backend) -> None:
    """Rows declared but unchanged: nothing of the leaf but its zarr.json is written, every
    chunk is held by the base's attempt, and the step restores and verifies."""
    first = table()
    r1 = await save(local, first, 1)
    got = await save(local, first, 2, base=r1, changed={"emb": [5, 600]})
    assert got.bytes_written == 32  # the bias alone
    item = (await load_committed(local, 2)).items["state"]
    assert "emb" not in item.refs
    assert item.chunk_refs["emb"].to_json() == {"0": [[0, 64]]}
    assert_same((await ckptstore.restore(local, 2))["emb"], first)
    assert (await ckptstore.verify(local, 2)).ok


async def test_no_rows_declared_references_the_leaf_whole(local: Backend) -> None:
    first = table()
    await save(local, first, 1)
    got = await save(local, first, 2, base=1, changed={"emb": np.array([], np.int64)})
    assert got.bytes_written == 32  # the bias alone
    item = (await load_committed(local, 2)).items["state"]
    assert "emb" in item.refs and not item.chunk_refs
    assert_same((await ckptstore.restore(local, 2))["emb"], first)


async def test_the_declaration_is_trusted_an_undeclared_change_is_not_saved(
    local: Backend,
) -> None:
    """What the feature is for: undeclared chunks are neither read nor hashed. So a row
    changed but not declared keeps the base's value (the documented contract), while the
    declared one is saved."""
    first = table()
    await save(local, first, 1)
    later = touched(first, 3, 700)
    await save(local, later, 2, base=1, changed={"emb": [700]})
    got = (await ckptstore.restore(local, 2))["emb"]
    np.testing.assert_array_equal(got[700], later[700])
    np.testing.assert_array_equal(got[3], first[3])  # undeclared: the base's


async def test_sharded_pieces_and_a_resharded_restore(local: Backend) -> None:
    """Over 8 devices each piece's chunks are taken from the declaration, bit-exact."""
    sharding = NamedSharding(
        Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y")), P("x", "y")
    )
    first = table()
    r1 = await save(local, jax.device_put(first, sharding), 1)
    later = touched(first, 5, 999)
    got = await save(local, jax.device_put(later, sharding), 2, base=r1, changed={"emb": [5, 999]})
    assert got.bytes_written == 4 * CHUNK_BYTES + 32
    other = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("a",)), P(None, "a"))
    like = {"emb": jax.ShapeDtypeStruct(later.shape, later.dtype, sharding=other)}
    restored = await ckptstore.restore(local, 2, like, partial=True)
    np.testing.assert_array_equal(np.asarray(restored["emb"]), later)
    assert (await ckptstore.verify(local, 2)).ok


async def test_a_leaf_the_base_stored_otherwise_is_hashed_and_written(local: Backend) -> None:
    """Another chunk shape in the base: no digests to take, so the leaf is written whole,
    its declaration notwithstanding (it cannot make the save wrong)."""
    first = table()
    await ckptstore.save(local, tree(first, 1), step=1, chunk_bytes=CHUNK * 4)
    later = touched(first, 3, 500)
    got = await save(local, later, 2, base=1, changed={"emb": [3]})
    assert got.bytes_written == later.nbytes + 32
    assert_same((await ckptstore.restore(local, 2))["emb"], later)


async def test_a_base_committed_again_since_the_result_named_is_refused(local: Backend) -> None:
    """``base=`` a `SaveResult`: the declaration is relative to that attempt; a step 1
    deleted and saved again by another writer is `BaseStepGoneError`, nothing written."""
    first = table()
    r1 = await save(local, first, 1)
    await ckptstore.delete_step(local, 1)
    await save(local, table(7), 1)  # another writer's step 1
    with pytest.raises(BaseStepGoneError, match="no longer committed as attempt"):
        await save(local, touched(first, 3), 2, base=r1, changed={"emb": [3]})
    assert await ckptstore.list_steps(local) == [1]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"changed": {"emb": [3]}}, "give base= too"),
        ({"base": 1, "changed": {"nope": [3]}}, "leaf 'nope', which the tree does not have"),
        ({"base": 1, "changed": {"emb": [1024]}}, r"row 1024 is outside 0\.\.1023"),
        ({"base": 1, "changed": {"emb": [-1]}}, "row -1 is outside"),
        ({"base": 1, "changed": {"emb": [1.5]}}, "integer row indices"),
        ({"base": 1, "changed": {"emb": [[1, 2]]}}, "1-d sequence"),
        ({"base": 1, "changed": {"emb": np.ones(3, bool)}}, r"one entry per row \(1024\), not 3"),
        ({"base": 1, "changed": {"s": [0]}}, "a scalar: it has no rows"),
        ({"base": 1, "changed": [3]}, "must map"),
    ],
)
async def test_a_bad_declaration_is_a_config_error_before_any_write(
    local: Backend, kw: dict[str, Any], message: str
) -> None:
    await save(local, table(), 1)
    with pytest.raises(ConfigError, match=message):
        await ckptstore.save(
            local, {**tree(table(), 2), "s": np.float32(1)}, step=2, chunk_bytes=CHUNK, **kw
        )
    assert await ckptstore.list_steps(local) == [1]
    assert not [k async for k in local.list(layout.step_dir(2))]


async def test_save_items_names_the_item_it_does_not_have(local: Backend) -> None:
    await save_items(local, {"state": tree(table(), 1)}, step=1, chunk_bytes=CHUNK)
    with pytest.raises(ConfigError, match="item 'other', which is not saved"):
        await save_items(
            local, {"state": tree(table(), 2)}, step=2, base=1, changed={"other": {"emb": [1]}}
        )
