"""The OCDBT index restores use to read chunk data from local data files directly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.datapath import ocdbt_index


def _store(root: Path, **config: int) -> ts.KvStore:
    spec = {"driver": "ocdbt", "base": f"file://{root}/", "config": config}
    return ts.KvStore.open(spec).result()


@pytest.mark.parametrize("node_bytes", [512, 8 << 20])  # a tree of height 2, and one leaf node
async def test_index_reads_every_value_as_tensorstore_does(tmp_path: Path, node_bytes: int) -> None:
    kv = _store(tmp_path / "s", max_decoded_node_bytes=node_bytes, max_inline_value_bytes=8)
    rng = np.random.default_rng(0)
    sizes = [int(rng.integers(0, 3000)) if i % 4 else i % 9 for i in range(300)]  # some inline
    values = {f"leaf_{i:04d}/c/{i % 3}": rng.bytes(n) for i, n in enumerate(sizes)}
    with ts.Transaction() as txn:
        for key, value in values.items():
            kv.with_transaction(txn)[key] = value
    base = await ts.KvStore.open(f"file://{tmp_path}/s/")
    index = await ocdbt_index.load(base)
    assert index is not None and set(index) == set(values)
    assert any(isinstance(v, bytes) for v in index.values()), "some values are inline"
    chunks = ocdbt_index.DirectChunks(LocalBackend(tmp_path), "s", index)
    keys = [*values, "not/a/key"]
    got = await chunks.get(keys)
    assert got[-1] is None
    for key, buf in zip(keys, got[:-1], strict=False):
        assert buf is not None and bytes(buf) == values[key], key
        assert buf.flags.writeable and (buf.ctypes.data % 64 == 0 or not len(buf))


def test_locations_that_leave_the_store_are_refused() -> None:
    assert ocdbt_index._parse("value:ocdbt.process_0/:d/ab12:870:43236") == ocdbt_index.Location(
        "ocdbt.process_0/d/ab12", 870, 43236
    )
    assert ocdbt_index._parse("value::d/ab12:0:4") == ocdbt_index.Location("d/ab12", 0, 4)
    for bad in [
        "value::../other/d/ab:0:4",
        "value:/etc/:passwd:0:4",
        "value::d/a b:0:4",
        "btreenode::d/ab:0:4",
        "value::d/ab:0",
    ]:
        assert ocdbt_index._parse(bad) is None, bad


async def test_not_an_ocdbt_store_gives_no_index(tmp_path: Path) -> None:
    (tmp_path / "manifest.ocdbt").write_bytes(b"not a manifest")
    assert await ocdbt_index.load(await ts.KvStore.open(f"file://{tmp_path}/")) is None


class CountingLocal(LocalBackend):
    reads_into = 0

    async def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> int:
        type(self).reads_into += 1
        return await super()._read_into(key, offset, outs)


async def test_local_restores_read_data_files_directly(tmp_path: Path) -> None:
    tree = {"big": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}
    tree |= {f"s{i}": np.full(i + 1, i, np.int16) for i in range(50)}
    backend = CountingLocal(tmp_path)
    await ckptstore.save(backend, tree, step=1)
    out = await ckptstore.restore(backend)
    assert CountingLocal.reads_into > 0
    for key, value in tree.items():
        np.testing.assert_array_equal(out[key], value)


async def test_a_tree_claiming_more_than_the_file_holds_is_corrupt(tmp_path: Path) -> None:
    """A hand-edited tree must not size a buffer: the claim is checked against the file."""
    kv = _store(tmp_path / "s")
    await kv.write("k", b"x" * 1000)
    index = await ocdbt_index.load(await ts.KvStore.open(f"file://{tmp_path}/s/"))
    assert index is not None
    where = index["k"]
    assert isinstance(where, ocdbt_index.Location)
    index["huge"] = ocdbt_index.Location(where.path, where.offset, 1 << 45)
    index["gone"] = ocdbt_index.Location("d/does-not-exist", 0, 10)
    chunks = ocdbt_index.DirectChunks(LocalBackend(tmp_path), "s", index)
    with pytest.raises(ckptstore.CorruptCheckpointError, match="ends at byte"):
        await chunks.get(["huge"])
    with pytest.raises(ckptstore.CorruptCheckpointError, match="is missing"):
        await chunks.get(["gone"])
    assert bytes((await chunks.get(["k"]))[0]) == b"x" * 1000  # type: ignore[arg-type]
