"""`Manifest.references` and `Manifest.base` are `Reference`s in memory and stay
``{"step": s, "attempt": a}`` on disk, byte for byte, checked as the parser always did."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import ItemManifest, Manifest, Reference

A1 = "attempt-20260101T000000-000000000001"
A2 = "attempt-20260101T000000-000000000002"
A3 = "attempt-20260101T000000-000000000003"

#: What this manifest's bytes were while references were dicts (format version 4).
GOLDEN = (
    '{"format":"ckptstore","format_version":4,"step":3,'
    '"attempt":"attempt-20260101T000000-000000000003","created":12.5,'
    '"checksums":"crc32c per chunk (zarr3 crc32c codec), verified on every read",'
    '"metadata":{},"references":[{"step":2,"attempt":"attempt-20260101T000000-000000000002"},'
    '{"step":1,"attempt":"attempt-20260101T000000-000000000001"}],"timings":{},"processes":[],'
    '"items":{"state":{"structure":{"t":"dict","keys":[["str","w"],["str","v"]],'
    '"items":[{"t":"leaf","name":"w"},{"t":"leaf","name":"v"}]},"parts":[],'
    '"leaves":{"w":{"shape":[4],"dtype":"float32","chunk_shape":[4],"kind":"numpy",'
    '"python_type":null,"sharding":null,"nbytes":16},"v":{"shape":[4],"dtype":"float32",'
    '"chunk_shape":[4],"kind":"numpy","python_type":null,"sharding":null,"nbytes":16}},'
    '"packed":{},"refs":{"w":1,"v":0}}},'
    '"base":{"step":2,"attempt":"attempt-20260101T000000-000000000002"}}'
)


def incremental() -> Manifest:
    """Step 3, whose leaf "w" step 1's attempt holds and "v" step 2's, on base 2."""
    structure = {
        "t": "dict",
        "keys": [["str", "w"], ["str", "v"]],
        "items": [{"t": "leaf", "name": "w"}, {"t": "leaf", "name": "v"}],
    }
    leaves = {
        n: LeafInfo(name=n, shape=(4,), dtype="float32", chunk_shape=(4,), kind="numpy")
        for n in "wv"
    }
    return Manifest(
        step=3,
        attempt=A3,
        created=12.5,
        items={"state": ItemManifest(structure, leaves, refs={"w": 1, "v": 0})},
        references=[Reference(2, A2), Reference(1, A1)],
        base=Reference(2, A2),
        format_version=layout.REFERENCES_VERSION,
    )


def test_references_are_written_byte_for_byte_as_before() -> None:
    manifest = incremental()
    assert manifest.to_bytes() == GOLDEN.encode()
    again = Manifest.from_bytes(GOLDEN.encode(), where="golden")
    assert again.references == [Reference(2, A2), Reference(1, A1)]
    assert again.base == Reference(2, A2) and type(again.base) is Reference
    assert again.to_bytes() == GOLDEN.encode()
    assert again.leaf_dir("state", "w") == f"1/{A1}/state"
    assert again.leaf_dir("state", "v") == f"2/{A2}/state"


def test_a_reference_is_typed_hashable_and_names_its_attempt() -> None:
    ref = Reference.from_json({"step": 1, "attempt": A1})
    assert (ref.step, ref.attempt) == (1, A1)
    assert ref.to_json() == {"step": 1, "attempt": A1}
    assert list(ref.to_json()) == ["step", "attempt"]  # the order written
    assert ref.dir == layout.AttemptDir(1, A1) and ref.dir.root == f"1/{A1}"
    assert {ref, Reference(1, A1)} == {ref}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.step = 2  # type: ignore[misc]
    # Keys beyond the two are ignored when read, as they always were.
    assert Reference.from_json({"step": 1, "attempt": A1, "other": 0}) == ref


@pytest.mark.parametrize(
    "doc",
    [
        {"step": "1", "attempt": A1},
        {"step": True, "attempt": A1},
        {"step": -1, "attempt": A1},
        {"step": 1.0, "attempt": A1},
        {"step": 1, "attempt": "../x"},
        {"step": 1},
        [1, A1],
        None,
    ],
)
def test_a_bad_reference_is_refused_as_the_parser_always_did(doc: Any) -> None:
    with pytest.raises(ValueError, match=r"^bad reference "):
        Reference.from_json(doc)
    with pytest.raises(ValueError, match=r"^bad base "):
        Reference.from_json(doc, "base")
    as_reference = json.loads(GOLDEN)
    as_reference["references"].append(doc)
    with pytest.raises(CorruptCheckpointError, match="W: bad reference "):
        Manifest.from_bytes(json.dumps(as_reference).encode(), where="W")
    if doc is not None:  # a null base is a manifest without one
        as_base = {**json.loads(GOLDEN), "base": doc}
        with pytest.raises(CorruptCheckpointError, match="W: bad base "):
            Manifest.from_bytes(json.dumps(as_base).encode(), where="W")


def test_a_manifest_naming_its_own_attempt_is_refused() -> None:
    itself = {"step": 3, "attempt": A3}
    for edit, why in (
        (lambda d: d["references"].append(itself), "references its own attempt"),
        (lambda d: d.update(base=itself), "names its own attempt as its base"),
    ):
        bad = json.loads(GOLDEN)
        edit(bad)
        with pytest.raises(CorruptCheckpointError, match=why):
            Manifest.from_bytes(json.dumps(bad).encode(), where="W")


def test_the_manifest_says_which_attempt_holds_each_leaf() -> None:
    """`Manifest.holder`/`held`/`chunk_holders`: the one way to ask where bytes live."""
    manifest = incremental()
    assert manifest.holder("state", "w") == Reference(1, A1)
    assert manifest.holder("state", "v") == Reference(2, A2)
    assert manifest.held("state") == {
        Reference(2, A2): frozenset({"v"}),
        Reference(1, A1): frozenset({"w"}),
    }
    assert list(manifest.held("state")) == manifest.references  # in their order
    [(holder, mask)] = manifest.chunk_holders("state", "w", np.array([0, 1]))
    assert holder == Reference(1, A1) and mask.tolist() == [True, True]
    own = Manifest(
        step=3,
        attempt=A3,
        items={"state": ItemManifest(manifest.items["state"].structure, {})},
    )
    assert own.held("state") == {}
