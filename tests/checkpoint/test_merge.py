"""The merge copies references, not data, and validates before its single commit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.merge import merge
from ckptstore.datapath.arrays import write_leaves
from ckptstore.datapath.stores import ocdbt_spec
from ckptstore.errors import IncompleteCheckpointError
from ckptstore.format.leaves import LeafInfo, describe_leaf

MiB = 1 << 20


async def stored_bytes(backend: Backend) -> int:
    return sum([info.size async for info in backend.list()])


async def write_child(
    backend: Backend, child: str, leaves: dict[str, np.ndarray]
) -> list[LeafInfo]:
    infos = [describe_leaf(name, value) for name, value in leaves.items()]
    await write_leaves(
        ocdbt_spec(backend.kvstore_spec(child)),
        backend.ts_context,
        list(zip(infos, leaves.values(), strict=True)),
        process=0,
        write_metadata=True,
    )
    return infos


async def test_merge_copies_references_not_data(any_backend: Backend) -> None:
    rng = np.random.default_rng(1)
    infos: list[LeafInfo] = []
    data = {}
    for p in range(8):
        leaves = {f"leaf{p}": rng.standard_normal((512, 512), dtype=np.float32)}
        data.update(leaves)
        infos += await write_child(any_backend, f"item/ocdbt.process_{p}", leaves)
    before = await stored_bytes(any_backend)
    assert before > 8 * MiB

    stats = await merge(any_backend, "item", [f"item/ocdbt.process_{p}" for p in range(8)], infos)

    added = await stored_bytes(any_backend) - before
    assert stats.stores == 8
    assert 0 < added < 64 * 1024, f"merge wrote {added} bytes for an 8 MiB payload"
    parent = ocdbt_spec(any_backend.kvstore_spec("item"))
    for name, value in data.items():
        arr = await ts.open(
            {"driver": "zarr3", "kvstore": {**parent, "path": f"{name}/"}},
            context=any_backend.ts_context,
        )
        np.testing.assert_array_equal(await arr.read(), value)


async def test_incomplete_merge_names_leaves_and_commits_nothing(any_backend: Backend) -> None:
    good = await write_child(any_backend, "item/ocdbt.process_0", {"good": np.ones((4, 4))})
    # "partial": metadata says two chunks, only one is written.
    partial = LeafInfo("partial", (8,), "float32", (4,), "numpy")
    child = ocdbt_spec(any_backend.kvstore_spec("item/ocdbt.process_1"))
    arr = await ts.open(
        {
            "driver": "zarr3",
            "kvstore": {**child, "path": "partial/"},
            "metadata": {
                "shape": [8],
                "data_type": "float32",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
            },
        },
        create=True,
        context=any_backend.ts_context,
    )
    await arr[:4].write(np.ones(4, np.float32))
    absent = LeafInfo("absent", (2,), "float32", (2,), "numpy")
    wrong = LeafInfo("good", (5, 5), "float64", (5, 5), "numpy")

    with pytest.raises(IncompleteCheckpointError) as info:
        await merge(
            any_backend,
            "item",
            ["item/ocdbt.process_0", "item/ocdbt.process_1"],
            [*good, partial, absent],
        )
    assert set(info.value.leaves) == {"partial", "absent"}
    assert "1 of 2 chunks missing" in info.value.leaves["partial"]
    assert "zarr.json missing" in info.value.leaves["absent"]

    with pytest.raises(IncompleteCheckpointError, match=r"zarr\.json says float64"):
        await merge(any_backend, "item", ["item/ocdbt.process_0"], [wrong])

    parent = await ts.KvStore.open(
        ocdbt_spec(any_backend.kvstore_spec("item")), context=any_backend.ts_context
    )
    assert await parent.list() == []  # nothing committed


async def test_validation_reads_metadata_not_only_its_spelling(any_backend: Backend) -> None:
    """A ``zarr.json`` byte for byte as a save writes it is accepted without parsing; any
    other spelling is parsed: the same document reformatted passes, garbage does not."""
    infos = await write_child(
        any_backend, "item/ocdbt.process_0", {"a": np.ones(4, np.float32), "b": np.ones(3)}
    )
    kv = await ts.KvStore.open(
        ocdbt_spec(any_backend.kvstore_spec("item/ocdbt.process_0")),
        context=any_backend.ts_context,
    )
    original = (await kv.read("a/zarr.json")).value
    await kv.write("a/zarr.json", json.dumps(json.loads(original), indent=2).encode())
    await kv.write("b/zarr.json", b"not json")

    with pytest.raises(IncompleteCheckpointError) as info:
        await merge(any_backend, "item", ["item/ocdbt.process_0"], infos)
    assert set(info.value.leaves) == {"b"}
    assert "zarr.json is not a JSON object" in info.value.leaves["b"]
