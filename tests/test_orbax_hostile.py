"""Hostile Orbax metadata: a ``_METADATA`` sequence index of 10**30 raised an untyped
TypeError (JAX's SequenceKey takes a C int); now a `CorruptCheckpointError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptstore
from ckptstore.cli import main as cli


def orbax_save(path: Path, tree: Any, ocdbt: bool) -> None:
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=ocdbt)
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    checkpointer.close()


@pytest.mark.parametrize("index", ["1" + "0" * 30, str(2**63), str(2**31), "3"])
def test_a_huge_sequence_index_is_a_typed_error(index: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    orbax_save(path, {"w": np.arange(4.0), "l": [np.ones(2), np.zeros(2)]}, ocdbt=False)
    meta = json.loads((path / "_METADATA").read_text())
    meta["tree_metadata"]["('l', '1')"]["key_metadata"][1]["key"] = index
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(ckptstore.CorruptCheckpointError, match="sequence index"):
        ckptstore.restore_sync(path)
    assert cli(["info", str(path)]) == 1
