"""A third-party package as pip installs it, for the tests of ckptstore's entry points."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def installed(root: Path, name: str, source: str, group: str, entry: str) -> Iterator[None]:
    """Module ``name`` (``source``) and its dist-info below ``root``, on ``sys.path`` for the
    block: its ``entry_points.txt`` names ``entry`` (``key = module:attr``) in ``group``."""
    (root / f"{name}.py").write_text(source)
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry}\n")
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
