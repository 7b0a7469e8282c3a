"""A save onto a full disk, on a real (small) filesystem: a tmpfs mounted in a user and
mount namespace of its own (``unshare -rm``), so no privilege is needed beyond that."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import numpy as np
    import ckptstore

    root = sys.argv[1]
    first = {"a": np.arange(1000, dtype=np.float32)}
    ckptstore.save_sync(root, first, step=1)
    trees = {
        "one large leaf (TensorStore's writes)": {"w": np.ones(4 << 20, np.float32)},
        "many small leaves (packs)": {f"l{i}": np.ones(50_000, np.float32) for i in range(100)},
    }
    for name, tree in trees.items():
        try:
            ckptstore.save_sync(root, tree, step=2)
            print(name, "SAVED")
        except ckptstore.CkptStoreError as exc:
            transient = isinstance(exc, ckptstore.TransientStorageError)
            print(name, type(exc).__name__, "transient" if transient else "final", "|", exc)
    print("steps", ckptstore.list_steps_sync(root))
    got = ckptstore.restore_sync(root, step=1)
    print("step 1", bool(np.array_equal(got["a"], first["a"])))
    print("verify", ckptstore.verify_sync(root, step=1).ok)
    left = os.path.join(root, "2")
    print("left of step 2", sorted(os.listdir(left)) if os.path.exists(left) else [])
    ckptstore.save_sync(root, {"b": np.ones(1000, np.float32)}, step=2)  # no gc needed
    print("then", ckptstore.list_steps_sync(root))
    """
)


def test_a_save_onto_a_full_disk_fails_typed_and_keeps_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    """The save fails with `InsufficientSpaceError`, not a transient error a caller would
    retry (TensorStore calls a full disk RESOURCE_EXHAUSTED, as it does throttling); the
    step before it restores bit for bit and verifies, and the failed attempts are gone
    (a save by one process removes its own), so the next save that fits succeeds."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot mount a small filesystem without privileges")
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "full.py"
    script.write_text(SCRIPT)
    shell = (
        f'mount -t tmpfs -o size=8m tmpfs "{mount}" && exec "{sys.executable}" "{script}" "{mount}"'
    )
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{mount}"'],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    failures = [line for line in lines if line.startswith(("one large", "many small"))]
    assert len(failures) == 2, proc.stdout
    for line in failures:
        assert "InsufficientSpaceError final |" in line, line
        assert "the storage is full" in line and "No space left on device" in line, line
    assert "steps [1]" in lines, proc.stdout
    assert "step 1 True" in lines and "verify True" in lines, proc.stdout
    assert "left of step 2 []" in lines, proc.stdout
    assert lines[-1] == "then [1, 2]", proc.stdout
