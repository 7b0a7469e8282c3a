"""A forged manifest (its marker re-signed) that points an incremental step's references
elsewhere: `verify` flags it by hashing the bytes, and a restore refuses it too, by the
holders' own manifests (`checkpoint/holdercheck.py`), rather than return other values."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import CorruptCheckpointError
from tests.checkpoint.helpers import FROZEN, assert_same, lora, resign
from tests.checkpoint.test_chunk_refs import CHUNK, changed, table
from tests.paths import committed_root

Doc = dict[str, Any]


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[Backend]:
    b = LocalBackend(tmp_path / "ckpt")
    async with b:
        yield b


async def forge(backend: Backend, step: int, edit: Callable[[Doc], None]) -> bytes:
    """Edit committed ``step``'s manifest and re-sign its marker; returns the honest one."""
    honest = await backend.read(f"{await committed_root(backend, step)}/manifest.json")
    doc = json.loads(honest)
    edit(doc)
    await resign(backend, step, json.dumps(doc).encode())
    return honest


async def lora_steps(backend: Backend) -> dict[int, Any]:
    """Step 1 (a full save), step 2 referencing step 1's frozen base, step 3 another full
    save of the same shapes and other values, step 4 referencing step 3."""
    other = {**lora(3), "base": {"w": FROZEN + 1, "norm": np.linspace(1, 2, 7, dtype=np.float32)}}
    trees = {1: lora(1), 2: lora(2), 3: other, 4: {**other, "adapter": lora(4)["adapter"]}}
    await ckptstore.save(backend, trees[1], step=1)
    await ckptstore.save(backend, trees[2], step=2, base=1)
    await ckptstore.save(backend, trees[3], step=3)
    await ckptstore.save(backend, trees[4], step=4, base=3)
    return trees


def attempt_of(doc_of_step: Doc) -> Doc:
    return {"step": doc_of_step["step"], "attempt": doc_of_step["attempt"]}


async def manifest_doc(backend: Backend, step: int) -> Doc:
    root = await committed_root(backend, step)
    doc: Doc = json.loads(await backend.read(f"{root}/manifest.json"))
    return doc


async def test_a_reference_redirected_to_other_bytes_of_the_same_shapes(local: Backend) -> None:
    trees = await lora_steps(local)
    third = attempt_of(await manifest_doc(local, 3))
    await forge(local, 2, lambda doc: doc.update(references=[third]))
    assert not (await ckptstore.verify(local, step=2)).ok
    with pytest.raises(CorruptCheckpointError, match="recorded other digests") as info:
        await ckptstore.restore(local, 2)
    assert info.value.leaf is not None and info.value.leaf.startswith("base/")
    assert_same(await ckptstore.restore(local, 4), trees[4])  # the others still restore


async def test_a_false_digest_for_referenced_bytes(local: Backend) -> None:
    await lora_steps(local)

    def lie(doc: Doc) -> None:
        table_ = doc["items"]["state"]["digests"]["base/w"]
        table_[next(iter(table_))] = "0" * 32

    honest = await forge(local, 2, lie)
    assert not (await ckptstore.verify(local, step=2)).ok
    with pytest.raises(CorruptCheckpointError, match="recorded other digests"):
        await ckptstore.restore(local, 2)
    await resign(local, 2, honest)
    assert_same(await ckptstore.restore(local, 2), lora(2))


async def test_a_reference_to_an_attempt_that_references_it_too(local: Backend) -> None:
    """Step 4 points its frozen base at step 2, which itself reads it from step 1: a
    chain, never written by a save, where step 2's store does not hold those bytes."""
    await lora_steps(local)
    second = attempt_of(await manifest_doc(local, 2))
    await forge(local, 4, lambda doc: doc.update(references=[second]))
    with pytest.raises(CorruptCheckpointError, match="a reference of its own"):
        await ckptstore.restore(local, 4)
    assert not (await ckptstore.verify(local, step=4)).ok


async def test_chunks_redirected_to_a_holder_that_has_older_ones(local: Backend) -> None:
    """Every held chunk read from step 1, which has chunks 0-1 as they were before step
    2 changed them: intact bytes (crc32c passes), other values."""
    tree = {"emb": table(), "bias": np.arange(8, dtype=np.float32)}
    two = {**tree, "emb": changed(table(), 3)}
    three = {**tree, "emb": changed(table(), 3, 700)}
    await ckptstore.save(local, tree, step=1, chunk_bytes=CHUNK)
    await ckptstore.save(local, two, step=2, base=1, chunk_bytes=CHUNK)
    await ckptstore.save(local, three, step=3, base=2, chunk_bytes=CHUNK)

    def redirect(doc: Doc) -> None:
        refs = doc["items"]["state"]["chunk_refs"]["emb"]
        doc["items"]["state"]["chunk_refs"]["emb"] = {
            str(k): [[0, 42], [44, 64]]
            for k, r in enumerate(doc["references"])
            if r["step"] == 1 and str(k) in refs
        }

    await forge(local, 3, redirect)
    assert not (await ckptstore.verify(local, 3)).ok
    with pytest.raises(CorruptCheckpointError, match=r"chunk 0 .* another digest") as info:
        await ckptstore.restore(local, 3)
    assert info.value.leaf == "emb"


async def test_honest_incremental_steps_pass_the_checks(local: Backend) -> None:
    trees = await lora_steps(local)
    for step, tree in trees.items():
        assert_same(await ckptstore.restore(local, step), tree)
