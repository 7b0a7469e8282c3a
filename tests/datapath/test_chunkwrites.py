"""The chunks a write in part encodes itself (`datapath.chunkwrites.unheld_chunks`) are
byte for byte the chunks TensorStore's zarr3 driver writes, edge chunks included, and
their batches respect the budget."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.datapath.chunkwrites import unheld_batches, unheld_chunks
from ckptstore.format import chunks
from ckptstore.format.leaves import LeafInfo, zarr_spec


def tensorstore_chunks(info: LeafInfo, values: np.ndarray[Any, Any]) -> dict[str, bytes]:
    """Every stored key of ``values`` written by TensorStore itself, in memory."""
    ctx = ts.Context()
    arr = ts.open(zarr_spec({"driver": "memory"}, info), create=True, context=ctx).result()
    arr.write(values).result()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    return {key.decode(): kv.read(key).result().value for key in kv.list().result()}


@pytest.mark.parametrize(
    ("shape", "chunk_shape", "dtype", "codec"),
    [
        ((9, 5), (4, 2), "float32", None),  # edge chunks on both axes
        ((64, 16), (16, 8), "int16", None),
        ((10,), (4,), "float64", "zstd:1"),
    ],
)
def test_chunks_encoded_here_are_tensorstores_own(
    shape: tuple[int, ...], chunk_shape: tuple[int, ...], dtype: str, codec: str | None
) -> None:
    from ckptstore.format.codecs import CodecPolicy

    info = LeafInfo("t", shape, dtype, chunk_shape, "numpy")
    if codec is not None:
        (info,) = CodecPolicy.of(codec).apply([info])
    values = (np.arange(np.prod(shape)) % 251).astype(dtype).reshape(shape)
    theirs = tensorstore_chunks(info, values)
    whole = tuple(slice(0, n) for n in shape)
    batches = unheld_batches([(whole, values, True)], info, {0}, limit=1 << 30)
    assert batches is not None and len(batches) == 1
    ((piece, todo),) = batches[0][0]
    mine = unheld_chunks(piece[0], piece[1], info, todo)
    encoded = {chunks.chunk_key(info, coord): chunks.encode_region(info, c) for coord, c, _ in mine}
    assert len(encoded) == len(theirs) - 2  # all but zarr.json and the held chunk 0
    for key, data in encoded.items():
        if codec is None:
            assert data == theirs[key], key
        else:  # compressors may differ in bytes: equal once decoded
            np.testing.assert_array_equal(
                chunks.decode_chunk(info, data), chunks.decode_chunk(info, theirs[key])
            )
    assert sum(n for _, _, n in mine) == values.size - int(np.prod(chunk_shape))


def test_batches_keep_to_the_budget_and_skip_pieces_with_nothing_to_write() -> None:
    info = LeafInfo("t", (64, 8), "float32", (8, 8), "numpy")  # 8 chunks of 256 bytes
    values = np.zeros((64, 8), np.float32)
    pieces = [
        ((slice(k * 16, (k + 1) * 16), slice(0, 8)), values[k * 16 : (k + 1) * 16], True)
        for k in range(4)
    ]  # two chunks each
    held = {0, 1, 4}  # piece 0 all held, piece 2 half
    batches = unheld_batches(pieces, info, held, limit=800)
    assert batches is not None
    assert [[p[0][0].start for p, _ in b] for b, _ in batches] == [[16, 32], [48]]
    assert [[todo.tolist() for _, todo in b] for b, _ in batches] == [[[2, 3], [5]], [[6, 7]]]
    assert [n for _, n in batches] == [512 + 256, 512]
    alone = unheld_batches(pieces, info, held, limit=300)  # a piece over the limit: alone
    assert alone is not None
    assert [[p[0][0].start for p, _ in b] for b, _ in alone] == [[16], [32], [48]]
    everything = unheld_batches(pieces, info, set(range(8)), limit=800)
    assert everything == [([], 0)]  # one empty batch: process 0 still writes the zarr.json
    off = [((slice(4, 20), slice(0, 8)), values[4:20], True)]
    assert unheld_batches(off, info, held, limit=800) is None  # off the grid: TensorStore's
