"""Chunk references in the manifest (`ckptstore.format.chunkrefs`): written compactly as
ranges, read back equal, and every malformed record refused with a typed error."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.chunkrefs import ChunkRefs
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import ItemManifest, Manifest, Reference

A1 = "attempt-20260101T000000-000000000001"
A2 = "attempt-20260101T000000-000000000002"
A3 = "attempt-20260101T000000-000000000003"
N = 4096  # chunks of the table: a 256 MiB table of 64 KiB chunks


def manifest() -> Manifest:
    """Step 3: a table of 4096 chunks, most held by step 1, two ranges by step 2."""
    structure = {"t": "dict", "keys": [["str", "t"]], "items": [{"t": "leaf", "name": "t"}]}
    info = LeafInfo("t", (N * 16, 1024), "float32", (16, 1024), "numpy")
    held = {k: 1 for k in range(N) if k % 1000 not in (7, 8)}
    held.update({7: 0, 8: 0, 1007: 0})
    item = ItemManifest(
        structure,
        {"t": info},
        chunk_digests={"t": "ab" * 16 * N},
        chunk_refs={"t": ChunkRefs.of(held)},
    )
    return Manifest(
        step=3,
        attempt=A3,
        items={"state": item},
        references=[Reference(2, A2), Reference(1, A1)],
        base=Reference(2, A2),
        format_version=layout.FORMAT_VERSION,
    )


def test_round_trip_and_small() -> None:
    m = manifest()
    data = m.to_bytes()
    back = Manifest.from_bytes(data, where="test")
    assert back.items["state"].chunk_refs == m.items["state"].chunk_refs
    refs = back.items["state"].chunk_refs["t"]
    assert refs.holder(7) == 0 and refs.holder(9) == 1 and refs.holder(2007) is None
    assert refs.count == N - 7  # chunks 1008, 2007-2008, 3007-3008, 4007-4008 are its own
    # The holders are a few ranges, whatever the number of chunks; the digests dominate.
    assert len(json.dumps(m.items["state"].chunk_refs["t"].to_json())) < 200
    assert len(data) < 32 * N + 2000


def edited(edit: Callable[[dict[str, Any]], None]) -> bytes:
    doc = json.loads(manifest().to_bytes())
    edit(doc["items"]["state"])
    return json.dumps(doc).encode()


def _set_refs(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(item: dict[str, Any]) -> None:
        item["chunk_refs"]["t"] = value

    return edit


HOSTILE: dict[str, Callable[[dict[str, Any]], None]] = {
    "holder out of range": _set_refs({"2": [[0, 5]]}),
    "holder not an index": _set_refs({"-1": [[0, 5]]}),
    "holder with a leading zero": _set_refs({"01": [[0, 5]]}),
    "range past the grid": _set_refs({"0": [[0, N + 1]]}),
    "empty range": _set_refs({"0": [[5, 5]]}),
    "negative start": _set_refs({"0": [[-1, 5]]}),
    "range of floats": _set_refs({"0": [[0.0, 5]]}),
    "range of bools": _set_refs({"0": [[False, True]]}),
    "range of three": _set_refs({"0": [[0, 5, 6]]}),
    "unsorted ranges": _set_refs({"0": [[10, 20], [0, 5]]}),
    "overlapping holders": _set_refs({"0": [[0, 10]], "1": [[5, 20]]}),
    "no ranges": _set_refs({"0": []}),
    "not an object": _set_refs([[0, 5]]),
    "empty object": _set_refs({}),
    "unknown leaf": lambda item: item["chunk_refs"].update({"zz": {"0": [[0, 1]]}}),
    "refs not an object": lambda item: item.update({"chunk_refs": [1]}),
    "also held whole": lambda item: item.update({"refs": {"t": 0}}),
    "digests too short": lambda item: item["chunk_digests"].update({"t": "ab" * 16}),
    "digests not hex": lambda item: item["chunk_digests"].update({"t": "zz" * 16 * N}),
    "digests not a string": lambda item: item["chunk_digests"].update({"t": 5}),
    "single-chunk leaf": lambda item: item["leaves"]["t"].update(
        {"chunk_shape": item["leaves"]["t"]["shape"]}
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_malformed_chunk_references_are_typed(case: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_bytes(edited(HOSTILE[case]), where=case)


def test_an_older_reader_refuses_by_version() -> None:
    """Chunk references make the manifest format version 5: a reader of version 4 would read
    the leaf from the step's own store alone, so it must refuse the step instead."""
    assert layout.FORMAT_VERSION == 5 and layout.REFERENCES_VERSION == 4
    doc = json.loads(manifest().to_bytes())
    doc["format_version"] = 6
    with pytest.raises(CorruptCheckpointError, match="newer"):
        Manifest.from_bytes(json.dumps(doc).encode(), where="future")


@pytest.mark.parametrize(
    ("shape", "chunk_shape"),
    [((64, 1024), (8, 256)), ((10, 7, 3), (4, 3, 2)), ((9,), (4,)), ((), ()), ((0, 4), (1, 2))],
)
def test_chunks_size_counts_edge_chunks_as_the_regions_they_cover(
    shape: tuple[int, ...], chunk_shape: tuple[int, ...]
) -> None:
    import math
    import random

    from ckptstore.format.digests import chunk_count, chunk_region, chunks_size

    n = chunk_count(shape, chunk_shape)
    picks = random.Random(0).sample(range(n), n // 2) if math.prod(shape) else []
    want = sum(
        math.prod(
            len(range(*s.indices(d)))
            for s, d in zip(chunk_region(k, shape, chunk_shape), shape, strict=True)
        )
        for k in picks
    )
    assert chunks_size(picks, shape, chunk_shape) == want
    assert chunks_size(range(n) if math.prod(shape) else [], shape, chunk_shape) == math.prod(shape)
    with pytest.raises(ValueError, match="outside a chunk grid"):
        chunks_size([n], shape, chunk_shape)


def test_are_digests_checks_every_value() -> None:
    from ckptstore.format.digests import are_digests

    good = ["0123456789abcdef" * 2, "f" * 32]
    assert are_digests(good) and are_digests([])
    for bad in ("F" * 32, "0" * 31, "0" * 33, "g" * 32, 7, None):
        assert not are_digests([*good, bad]), bad


@pytest.mark.parametrize(
    ("shape", "chunk_shape", "index"),
    [
        ((64, 1024), (8, 256), (slice(16, 48), slice(0, 1024))),
        ((10, 7, 3), (4, 3, 2), (slice(4, 10), slice(3, 7), slice(0, 3))),
        ((9,), (4,), (slice(0, 9),)),
        ((), (), ()),
        ((64, 1024), (8, 256), (slice(4, 48), slice(0, 1024))),  # not on a boundary
        ((9,), (4,), (slice(0, 6),)),  # ends inside a chunk
    ],
)
def test_piece_linears_lists_what_piece_chunks_lists(
    shape: tuple[int, ...], chunk_shape: tuple[int, ...], index: tuple[slice, ...]
) -> None:
    from ckptstore.format.digests import piece_chunks, piece_linears

    chunks = piece_chunks(index, shape, chunk_shape) if shape else [(0, ())]
    linears = piece_linears(index, shape, chunk_shape)
    if chunks is None:
        assert linears is None
    else:
        assert linears is not None and linears.tolist() == [k for k, _ in chunks]


def _ranges_one_by_one(holders: dict[int, int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """The ranges a record must hold, built chunk by chunk (the model `ChunkRefs.of`'s
    vectorized runs are checked against)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for linear in sorted(holders):
        ranges = out.setdefault(holders[linear], [])
        if ranges and ranges[-1][1] == linear:
            ranges[-1] = (ranges[-1][0], linear + 1)
        else:
            ranges.append((linear, linear + 1))
    return {k: tuple(v) for k, v in sorted(out.items())}


@pytest.mark.parametrize("seed", range(6))
def test_ranges_and_owners_match_the_chunk_by_chunk_model(seed: int) -> None:
    """Random holders (runs, isolated chunks, holders interleaved, chunks left out): the
    record's ranges are the model's, and `owners` answers as `holder` does per chunk."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    present = rng.random(n) < rng.random()
    runs = np.cumsum(rng.random(n) < 0.1)  # holders change now and then, in runs
    holders = {k: int(runs[k] % 3) for k in range(n) if present[k]}
    refs = ChunkRefs.of(holders)
    assert dict(refs.held) == _ranges_one_by_one(holders)
    everything = np.arange(n + 5, dtype=np.int64)  # past the last held chunk too
    assert refs.owners(everything).tolist() == [
        -1 if refs.holder(k) is None else refs.holder(k) for k in everything.tolist()
    ]
    assert ChunkRefs.of({}).held == {} and refs.owners(np.zeros(0, np.int64)).size == 0


def test_chunk_holders_groups_chunks_by_holder_in_order_of_first_chunk() -> None:
    m = manifest()
    linears = np.array([6, 7, 8, 9, 1007, 1008], np.int64)
    found = m.chunk_holders("state", "t", linears)
    assert [(ref, mask.tolist()) for ref, mask in found] == [
        (Reference(1, A1), [True, False, False, True, False, False]),
        (Reference(2, A2), [False, True, True, False, True, False]),
        (None, [False, False, False, False, False, True]),  # 1008: the step's own
    ]
    assert m.chunk_holders("state", "t", np.zeros(0, np.int64)) == []


@pytest.mark.parametrize(
    ("shape", "chunk_shape", "index"),
    [
        ((64, 1024), (8, 256), (slice(16, 48), slice(0, 1024))),
        ((10, 7, 3), (4, 3, 2), (slice(4, 10), slice(3, 7), slice(0, 3))),
        ((9,), (4,), (slice(0, 9),)),
    ],
)
def test_regions_in_piece_are_each_chunks_region_less_the_pieces_start(
    shape: tuple[int, ...], chunk_shape: tuple[int, ...], index: tuple[slice, ...]
) -> None:
    from ckptstore.format.digests import chunk_region, piece_linears, regions_in_piece

    linears = piece_linears(index, shape, chunk_shape)
    assert linears is not None
    starts = [s.start for s in index]
    expected = [
        tuple(
            slice(r.start - a, r.stop - a)
            for r, a in zip(chunk_region(k, shape, chunk_shape), starts, strict=True)
        )
        for k in linears.tolist()
    ]
    assert regions_in_piece(linears, index, shape, chunk_shape) == expected
    with pytest.raises(ValueError, match="outside a chunk grid"):
        regions_in_piece(np.array([10_000], np.int64), index, shape, chunk_shape)
