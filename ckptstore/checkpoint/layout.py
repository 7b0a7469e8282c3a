"""Names of everything a checkpoint stores, relative to the backend root.

```
<step>/
  <item>/                               e.g. "state"
    ocdbt.process_<i>/                  process i's own OCDBT store (manifest.ocdbt, d/...)
    pending_<k>/ocdbt.process_<i>/      partial save k
    manifest.ocdbt, d/                  the merged OCDBT store: references only
  manifest.json                         tree structure, leaves, per-process statistics
  COMMITTED                             created last; its presence means committed
```
"""

from __future__ import annotations

from ckptstore.errors import CkptStoreError

MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
DEFAULT_ITEM = "state"
FORMAT = "ckptstore"
FORMAT_VERSION = 1


def check_step(step: int) -> int:
    """Steps are non-negative integers."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CkptStoreError(f"step must be a non-negative int, got {step!r}")
    return step


def step_dir(step: int) -> str:
    return str(check_step(step))


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a step directory."""
    return int(name) if name.isdigit() and (name == "0" or not name.startswith("0")) else None


def item_dir(step: int, item: str) -> str:
    return f"{step_dir(step)}/{item}"


def process_store(step: int, item: str, process: int) -> str:
    return f"{item_dir(step, item)}/ocdbt.process_{process}"


def pending_dir(step: int, item: str, part: int) -> str:
    return f"{item_dir(step, item)}/pending_{part}"


def pending_store(step: int, item: str, part: int, process: int) -> str:
    return f"{pending_dir(step, item, part)}/ocdbt.process_{process}"


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def commit_key(step: int) -> str:
    return f"{step_dir(step)}/{COMMIT_MARKER}"
