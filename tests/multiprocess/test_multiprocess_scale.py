"""Many real JAX processes (one CPU device each, jax.distributed) save one tree sharded
over all of them; another number of processes, and one process alone, restore it bit for
bit (tests/multiprocess/scale_worker.py).

`make test` runs 8 processes; ``CKPTSTORE_SCALE_PROCESSES=8,16`` (`make scale`) adds 16,
which on a 2-core machine takes longer than `make test` should.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.testing.servers import free_port
from tests.multiprocess.scale_worker import SHAPES, expected

WORKER = Path(__file__).with_name("scale_worker.py")
COUNTS = [int(n) for n in os.environ.get("CKPTSTORE_SCALE_PROCESSES", "8").split(",")]
#: The restoring job's size for each saving job's: another count, not a divisor of it.
RESTORE_WITH = {8: 3, 16: 6}


def run_job(root: Path, mode: str, num: int, timeout: float = 300) -> list[str]:
    """Run ``num`` workers in ``mode``; each must exit 0. Their outputs."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(num), str(i), str(root), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=WORKER.parents[1],
            env=env,
        )
        for i in range(num)
    ]
    outputs = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{err[-3000:]}"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


@pytest.mark.parametrize("num", COUNTS)
def test_many_processes_save_and_another_count_restores_bit_exact(tmp_path: Path, num: int) -> None:
    root = tmp_path / "ckpt"
    start = time.monotonic()
    saved = run_job(root, "save", num)
    save_seconds = time.monotonic() - start
    assert all(o.startswith("saved ") for o in saved), saved
    written = [int(o.split()[1]) for o in saved]
    payload = sum(expected(k).nbytes for k in SHAPES)
    assert sum(written) == payload  # every byte once: shards split, the replicated leaf once
    assert all(w > 0 for w in written)  # every process wrote its own shards

    (attempt,) = (root / "1").glob("attempt-*")
    stores = sorted(p.name for p in (attempt / "state").glob("ocdbt.process_*"))
    assert stores == sorted(f"ocdbt.process_{i}" for i in range(num))
    manifest = json.loads((attempt / "manifest.json").read_text())
    assert [p["process"] for p in manifest["processes"]] == list(range(num))

    again = RESTORE_WITH.get(num, 3)
    start = time.monotonic()
    restored = run_job(root, "restore", again)
    restore_seconds = time.monotonic() - start
    assert all(o.startswith("restored ok") for o in restored), restored

    whole = ckptstore.restore_sync(str(root))  # one process, numpy, every leaf whole
    for k in SHAPES:
        assert isinstance(whole[k], np.ndarray)
        assert whole[k].dtype == expected(k).dtype
        assert whole[k].tobytes() == expected(k).tobytes(), k
    assert ckptstore.verify_sync(str(root), 1).ok
    print(
        f"{num} processes saved in {save_seconds:.1f} s; {again} restored: {restore_seconds:.1f} s"
    )
