"""`StreamedPiece`: a piece's digest made from slabs of its first axis is the digest
`piece_digests` makes of the whole piece, for every slab size, grid and piece."""

from __future__ import annotations

import numpy as np
import pytest

from ckptstore.format.digests import StreamedPiece, piece_digests
from ckptstore.format.leaves import Index

GRIDS = [
    ((10, 6), (3, 4)),
    ((7,), (2,)),
    ((9, 5, 3), (2, 5, 3)),
    ((4, 4), (4, 4)),  # one chunk: digested whole
    ((), ()),
    ((12, 8), (5, 3)),
]


def pieces(shape: tuple[int, ...], chunk: tuple[int, ...]) -> list[Index]:
    whole = tuple(slice(0, d) for d in shape)
    if not shape:
        return [whole]
    on_chunks = (slice(chunk[0], shape[0]), *whole[1:])
    off_chunks = (slice(1, shape[0] - 1), *whole[1:])  # digested whole
    return [whole, on_chunks, off_chunks]


@pytest.mark.parametrize(("shape", "chunk"), GRIDS)
@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<i8"])
def test_slabs_digest_like_the_whole_piece(
    shape: tuple[int, ...], chunk: tuple[int, ...], dtype: str
) -> None:
    values = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    for index in pieces(shape, chunk):
        want, _ = piece_digests(values[index], index, shape, chunk)
        for max_bytes in (1, 13, 40, 1 << 20):
            streamed = StreamedPiece(index, shape, chunk, values.itemsize, max_bytes)
            assert max_bytes < values.nbytes or len(streamed.slabs) == 1
            for slab in streamed.slabs:
                streamed.add(values[slab])
            assert streamed.hexdigest() == want, (index, max_bytes)


def test_a_piece_not_fully_added_has_no_digest() -> None:
    streamed = StreamedPiece((slice(0, 8),), (8,), (2,), 4, 8)
    streamed.add(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="not added"):
        streamed.hexdigest()
