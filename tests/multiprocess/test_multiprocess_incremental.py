"""Incremental saves by real JAX processes (one CPU device each, jax.distributed): each
process decides for the pieces it owns, and one agreement round makes a leaf referenced
whole or written whole, in a save and in a partial save's parts
(tests/multiprocess/incremental_worker.py, docs/incremental.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.testing.servers import free_port
from tests.multiprocess.incremental_worker import (
    CHANGED,
    CHANGED_M,
    DTYPES,
    SHAPES,
    UNDECLARED,
    expected,
)

WORKER = "tests.multiprocess.incremental_worker"
REPO = Path(__file__).parents[2]
LEAVES = sorted([*SHAPES, "host"])


def run_job(root: Path, num: int, timeout: float = 180) -> list[list[dict[str, Any]]]:
    """Run ``num`` workers; each must exit 0. Per process, its saves' reports."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER, coordinator, str(num), str(i), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for i in range(num)
    ]
    outputs = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{err[-3000:]}"
            outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def manifest(root: Path, step: int) -> dict[str, Any]:
    marker = json.loads((root / str(step) / "COMMITTED").read_text())
    return json.loads((root / str(step) / marker["attempt"] / "manifest.json").read_text())


def data_bytes(root: Path, step: int) -> int:
    """Bytes of chunk data (OCDBT data files and packs) below ``step``'s attempt."""
    attempt = manifest(root, step)["attempt"]
    return sum(
        p.stat().st_size
        for p in (root / str(step) / attempt).rglob("*")
        if p.is_file() and ("/d/" in p.as_posix() or p.name.startswith("pack-"))
    )


@pytest.mark.parametrize("num", [2, 4])
def test_processes_reference_unchanged_leaves_and_write_a_leaf_changed_on_one_whole(
    tmp_path: Path, num: int
) -> None:
    root = tmp_path / "ckpt"
    reports = run_job(root, num)
    assert [[r["step"] for r in mine] for mine in reports] == [[1, 2, 3, 4, 5]] * num
    payload = sum(expected(k, 1).nbytes for k in LEAVES)
    w_bytes = expected("w", 1).nbytes

    # Step 1: every byte written once, by the process that owns it.
    assert sum(mine[0]["written"] for mine in reports) == payload
    assert all(mine[0]["written"] > 0 for mine in reports)
    first = manifest(root, 1)
    assert set(first["items"]["state"]["digests"]) == set(LEAVES)
    assert data_bytes(root, 1) >= payload

    # Step 2, nothing changed: every leaf referenced, no chunk bytes written anywhere.
    assert [mine[1]["written"] for mine in reports] == [0] * num
    assert all(mine[1]["referenced"] == payload for mine in reports)
    second = manifest(root, 2)
    holder = {"step": 1, "attempt": first["attempt"]}
    assert second["references"] == [holder]
    assert second["base"] == holder
    assert sorted(second["items"]["state"]["refs"]) == LEAVES
    assert second["items"]["state"]["digests"] == first["items"]["state"]["digests"]
    assert data_bytes(root, 2) == 0

    # Step 3 (base=2), one element of the last process's shard of "w" changed there only:
    # "w" (one chunk per process's shard) is written in part: the last process writes its
    # chunk, each other one leaves its own out, a decision of its own (docs/incremental.md,
    # "Chunk references"); the rest is referenced, to step 1's attempt, which holds the
    # bytes (no chain through step 2).
    third = manifest(root, 3)
    assert third["references"] == [holder]
    assert third["base"] == {"step": 2, "attempt": second["attempt"]}
    assert sorted(third["items"]["state"]["refs"]) == [k for k in LEAVES if k != "w"]
    assert third["items"]["state"]["chunk_refs"] == {"w": {"0": [[0, num - 1]]}}
    assert third["format_version"] == 5
    shard = w_bytes // num
    assert [mine[2]["written"] for mine in reports] == [0] * (num - 1) + [shard]
    assert [mine[2]["referenced"] for mine in reports] == [payload - w_bytes + shard] * (
        num - 1
    ) + [payload - w_bytes]
    old, new = first["items"]["state"]["digests"]["w"], third["items"]["state"]["digests"]["w"]
    assert sorted(old) == sorted(new) and len(new) == num  # one piece per process
    differ = [bounds for bounds in new if new[bounds] != old[bounds]]
    assert differ == [f"{CHANGED[0] // (48 // num) * (48 // num)}:48,0:20"]
    assert 0 < data_bytes(root, 3) < payload

    # Step 4, a partial save on base 3, one part per leaf, one element of process 0's
    # shard of "m" changed there only: "m" is written whole, and so is "w", which step 3
    # holds in part (a part references leaves whole only); the rest is referenced, to
    # step 1's attempt, which wrote it.
    m_bytes = expected("m", 1).nbytes
    assert [mine[3]["parts"] for mine in reports] == [[[], [], ["steps"], ["bias"], ["host"]]] * num
    assert all(mine[3]["written"] == m_bytes + w_bytes for mine in reports)  # the parts' total
    assert all(mine[3]["referenced"] == payload - m_bytes - w_bytes for mine in reports)
    fourth = manifest(root, 4)
    refs = fourth["items"]["state"]["refs"]
    assert sorted(refs) == [k for k in LEAVES if k not in ("m", "w")]
    held = {k: fourth["references"][i] for k, i in refs.items()}
    assert all(held[k] == holder for k in held)
    old, new = first["items"]["state"]["digests"]["m"], fourth["items"]["state"]["digests"]["m"]
    assert [bounds for bounds in new if new[bounds] != old[bounds]] == [f"0:6,0:{96 // num}"]
    assert CHANGED_M[1] < 96 // num

    # Step 5 (base=3, "w" declared changed in a row of the last process's shard): only
    # that process reads and writes its chunk of "w"; the others take step 3's digests
    # for theirs unread, so process 0's undeclared change is not saved (the declaration is
    # trusted: docs/incremental.md, "Declared changes"). "m" changed since step 3 and is
    # written whole by its owners, as ever.
    fifth = manifest(root, 5)
    assert fifth["items"]["state"]["chunk_refs"]["w"] == {"0": [[0, num - 1]]}
    m_chunk = int(np.prod(fifth["items"]["state"]["leaves"]["m"]["chunk_shape"])) * 4
    assert [mine[4]["written"] for mine in reports] == [m_chunk] + [0] * (num - 2) + [shard]
    saved_w = expected("w", 5)
    saved_w[UNDECLARED] = expected("w", 3)[UNDECLARED]
    got = ckptstore.restore_sync(str(root), 5)
    assert got["w"].tobytes() == saved_w.tobytes()
    assert got["m"].tobytes() == expected("m", 5).tobytes()
    assert ckptstore.verify_sync(str(root), 5).ok

    # Another process count restores bit for bit: one process, whole numpy values, and
    # the sharded leaves onto this process's 8 devices.
    for step in (2, 3, 4):
        whole = ckptstore.restore_sync(str(root), step)
        for k in LEAVES:
            assert whole[k].dtype == expected(k, step).dtype
            assert whole[k].tobytes() == expected(k, step).tobytes(), (step, k)
        assert ckptstore.verify_sync(str(root), step).ok
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    like: dict[str, Any] = {
        k: jax.ShapeDtypeStruct(
            SHAPES[k], DTYPES[k], sharding=NamedSharding(mesh, P(*spec) if spec else P())
        )
        for k, spec in {"w": ("d",), "m": (None, "d"), "steps": ("d",), "bias": ()}.items()
    }
    like["host"] = expected("host", 4)
    for step in (3, 4):
        out = ckptstore.restore_sync(str(root), step, like=like)
        for k in LEAVES:
            assert np.asarray(out[k]).tobytes() == expected(k, step).tobytes(), (step, k)
