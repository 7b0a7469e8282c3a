"""A partial save's small manners: a `Part` prints as one short line, and a blocking
session left open at exit ends quietly (no traceback from asyncio's finalizer)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import ckptstore


def test_part_repr_is_one_short_line(tmp_path: Path) -> None:
    with ckptstore.partial_save_sync(str(tmp_path), step=1) as session:
        part = session.add({"a": {f"leaf{i}": np.zeros(4) for i in range(500)}})
        again = session.add({"a": {"leaf0": np.ones(4)}}, replace=True)
    assert repr(part) == f"<Part 0 {part.dir}: 500 leaves, 16000 bytes>"
    assert repr(again) == f"<Part 1 {again.dir}: 1 leaf, 32 bytes, replace>"
    assert len(repr(session.parts)) < 200  # was several KB per part
    assert part.leaves["a/leaf7"].nbytes == 32  # the record itself is all there


UNCLOSED = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ckptstore

    session = ckptstore.partial_save_sync(sys.argv[1], step=1)  # never closed
    session.add({"w": np.arange(8)})
    print("added", flush=True)
    """
)


def test_an_unclosed_blocking_session_ends_quietly(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-c", UNCLOSED, root], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout == "added\n"
    assert proc.stderr == "", proc.stderr  # was an AttributeError traceback at exit
    with ckptstore.partial_save_sync(root, step=1) as session:  # its part is there to resume
        assert [p.index for p in session.parts] == [0]
        session.finalize()
    np.testing.assert_array_equal(ckptstore.restore_sync(root, step=1)["w"], np.arange(8))
