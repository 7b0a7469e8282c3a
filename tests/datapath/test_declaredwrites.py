"""A declared leaf's write (`datapath.declaredwrites.write_declared`) hashes only the chunks
holding a declared row, writes exactly those that differ from the base, byte for byte as
TensorStore would store them (edge chunks included), and records the digests a save
hashing every chunk would record; a failing store fails it after its writes end."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.datapath.declaredwrites import DeclaredLeaf, write_declared
from ckptstore.format.chunkrefs import encode_digests
from ckptstore.format.digests import ChunkTable, chunk_count, piece_table
from ckptstore.format.leaves import Index, LeafInfo
from tests.datapath.test_chunkwrites import tensorstore_chunks

SHAPE, CHUNK = (70, 12), (8, 4)  # a 9 x 3 grid; the last band is 6 rows tall


def pieces_of(values: np.ndarray[Any, Any], cuts: list[int]) -> list[tuple[Index, Any, bool]]:
    """``values`` in pieces of whole rows starting at ``cuts`` (each on a band edge)."""
    bounds = [*cuts, values.shape[0]]
    return [
        ((slice(a, b), slice(0, values.shape[1])), values[a:b], False)
        for a, b in itertools.pairwise(bounds)
    ]


def digests_of(pieces: list[tuple[Index, Any, bool]], info: LeafInfo) -> tuple[Any, ChunkTable]:
    table: ChunkTable = {}
    found = asyncio.run(piece_table(pieces, info.shape, info.chunk_shape, 4, table))
    return found, table


def memory_store() -> ts.KvStore:
    spec = {"driver": "ocdbt", "base": {"driver": "memory"}}
    return ts.KvStore.open(spec, context=ts.Context()).result()


def run_write(
    kv: ts.KvStore,
    info: LeafInfo,
    new: np.ndarray[Any, Any],
    old: np.ndarray[Any, Any],
    rows: list[int],
    **kw: Any,
) -> tuple[Any, ChunkTable]:
    cuts = [0, 32]
    _, base = digests_of(pieces_of(old, cuts), info)
    recorded = encode_digests(base, chunk_count(info.shape, info.chunk_shape))
    pieces = pieces_of(new, cuts)
    declared = DeclaredLeaf.of(pieces, info, recorded, np.array(rows, np.int64))
    assert declared is not None
    table: ChunkTable = {}
    done = asyncio.run(
        write_declared(kv, ts.Context(), info, pieces, declared, table, write_metadata=True, **kw)
    )
    return done, table


@pytest.mark.parametrize("inflight", [1 << 30, 1])
def test_only_changed_declared_chunks_are_written_as_tensorstore_stores_them(
    inflight: int,
) -> None:
    info = LeafInfo("t", SHAPE, "float32", CHUNK, "numpy")
    old = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    new = old.copy()
    new[9, 1] += 1  # band 1, chunk (1, 0): declared
    new[66, 10] += 1  # band 8 (the edge band), chunk (8, 2): declared
    new[20, 5] += 1  # band 2, chunk (2, 1): changed but not declared
    kv = memory_store()
    done, table = run_write(kv, info, new, old, [9, 66], max_inflight_bytes=inflight)
    keys = sorted(k.decode() for k in kv.list().result())
    assert keys == ["t/c/1/0", "t/c/8/2", "t/zarr.json"]
    theirs = tensorstore_chunks(info, new)
    for key in keys:
        assert kv.read(key).result().value == theirs[key], key
    assert done.written == 2 and done.nbytes == (8 * 4 + 6 * 4) * 4
    assert done.held == set(range(27)) - {3, 26}
    # What a save hashing everything records, were the undeclared change not there.
    expected = old.copy()
    expected[0:16] = new[0:16]
    expected[64:] = new[64:]
    want, want_chunks = digests_of(pieces_of(expected, [0, 32]), info)
    assert done.table == want and table == want_chunks


def test_no_changed_chunk_writes_the_metadata_alone() -> None:
    info = LeafInfo("t", SHAPE, "float32", CHUNK, "numpy")
    old = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    kv = memory_store()
    done, _ = run_write(kv, info, old.copy(), old, [0, 69], max_inflight_bytes=1 << 30)
    assert [k.decode() for k in kv.list().result()] == ["t/zarr.json"]
    assert done.written == 0 and done.held == set(range(27))


def test_a_failing_store_fails_the_write(tmp_path: Path) -> None:
    info = LeafInfo("t", SHAPE, "float32", CHUNK, "numpy")
    old = np.zeros(SHAPE, np.float32)
    new = old + 1
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    spec = {"driver": "ocdbt", "base": f"file://{blocker}/store/"}
    kv = ts.KvStore.open(spec, context=ts.Context()).result()
    with pytest.raises(Exception):  # noqa: B017 - TensorStore's own error; the save types it
        run_write(kv, info, new, old, list(range(70)), max_inflight_bytes=1)


def test_the_declaration_does_not_help_off_the_grid_or_without_digests() -> None:
    info = LeafInfo("t", SHAPE, "float32", CHUNK, "numpy")
    values = np.zeros(SHAPE, np.float32)
    rows = np.array([1], np.int64)
    on_grid = pieces_of(values, [0, 32])
    _, base = digests_of(on_grid, info)
    recorded = encode_digests(base, 27)
    assert DeclaredLeaf.of(on_grid, info, None, rows) is None
    assert DeclaredLeaf.of(pieces_of(values, [0, 30]), info, recorded, rows) is None
    assert DeclaredLeaf.of(on_grid, info, recorded, rows) is not None
