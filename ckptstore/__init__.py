"""ckptstore: async-first checkpoint storage for JAX.

The public API on one screen:

- `save`, `restore`, `list_steps` (async) and `save_sync`, `restore_sync`,
  `list_steps_sync`: checkpoints of JAX pytrees, committed atomically. Every async entry
  point has a blocking ``_sync`` twin (Ctrl-C in one cancels the work before it returns).
- `partial_save(target, step)`: a `PartialSave` session (`add` parts, then `finalize`).
- `verify(target, step)`: a `VerifyReport`: would a restore return exactly what was saved?
- `delete_step(target, step)` and `gc(target, older_than=...)`: removing steps and garbage.
- `CheckpointManager(target, save_policy=..., keep_policy=..., options=ManagerOptions(...))`:
  saves from a training loop that pause it only for staging; policies in `ckptstore.policies`.
- `Tiered(fast=..., durable=...)`: a target like any other (save commits on the fast
  tier, reads use the nearest good copy, `delete_step`/`gc` cover both tiers);
  `promote(tiered)` copies committed steps from the fast tier to the durable one.
- `export_orbax(src, dst)` and `import_orbax(src, dst)`: a committed step as an Orbax
  0.12 checkpoint (by reference where possible), and an Orbax checkpoint as a step.
- `open_backend(url | profile=...)`: a `Backend` for local disk, memory, S3 or GCS.
- `Backend`, `ObjectInfo`, `Capabilities`, `RetryPolicy`: the storage protocol.
- The error hierarchy under `CkptStoreError`.

Importing ``ckptstore`` is cheap: the names below load their modules (and with them JAX
and TensorStore) on first use, so a ``conftest.py`` or a launcher can still configure JAX
after ``import ckptstore`` (the pytest plugin relies on this).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    CoordinationError,
    CorruptCheckpointError,
    DuplicateLeafError,
    FencedError,
    IncompleteCheckpointError,
    InsufficientMemoryError,
    InsufficientSpaceError,
    InvalidKeyError,
    InvalidStepError,
    InvalidURLError,
    NotFoundError,
    ObjectChangedError,
    PermissionDeniedError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
    TreeMismatchError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    from ckptstore.backends.base import Backend, Capabilities, ObjectInfo
    from ckptstore.backends.registry import load_profile, open_backend
    from ckptstore.backends.retry import RetryPolicy
    from ckptstore.checkpoint.blocking import (
        PartialSaveSync,
        delete_step_sync,
        gc_sync,
        list_steps_sync,
        partial_save_sync,
        read_manifest_sync,
        restore_sync,
        save_sync,
        verify_sync,
    )
    from ckptstore.checkpoint.cleanup import Removal, delete_step, gc
    from ckptstore.checkpoint.partial import Part, PartialSave, partial_save
    from ckptstore.checkpoint.save import SaveResult, save
    from ckptstore.checkpoint.verify import VerifyReport
    from ckptstore.lifecycle import policies
    from ckptstore.lifecycle.manager import CheckpointManager, SaveHandle, SaveStats
    from ckptstore.lifecycle.options import ManagerOptions
    from ckptstore.orbax.exporter import export_orbax, export_orbax_sync
    from ckptstore.orbax.importer import import_orbax, import_orbax_sync
    from ckptstore.tiers.promote import Promotion, promote, promote_sync
    from ckptstore.tiers.read import list_steps, read_manifest, restore, verify
    from ckptstore.tiers.target import Tiered

#: Each lazily loaded public name and the module that defines it.
_LAZY = {
    "Backend": "ckptstore.backends.base",
    "Capabilities": "ckptstore.backends.base",
    "ObjectInfo": "ckptstore.backends.base",
    "load_profile": "ckptstore.backends.registry",
    "open_backend": "ckptstore.backends.registry",
    "RetryPolicy": "ckptstore.backends.retry",
    "PartialSaveSync": "ckptstore.checkpoint.blocking",
    "delete_step_sync": "ckptstore.checkpoint.blocking",
    "gc_sync": "ckptstore.checkpoint.blocking",
    "list_steps_sync": "ckptstore.checkpoint.blocking",
    "partial_save_sync": "ckptstore.checkpoint.blocking",
    "read_manifest_sync": "ckptstore.checkpoint.blocking",
    "restore_sync": "ckptstore.checkpoint.blocking",
    "save_sync": "ckptstore.checkpoint.blocking",
    "verify_sync": "ckptstore.checkpoint.blocking",
    "Removal": "ckptstore.checkpoint.cleanup",
    "delete_step": "ckptstore.checkpoint.cleanup",
    "gc": "ckptstore.checkpoint.cleanup",
    "Part": "ckptstore.checkpoint.partial",
    "PartialSave": "ckptstore.checkpoint.partial",
    "partial_save": "ckptstore.checkpoint.partial",
    "Tiered": "ckptstore.tiers.target",
    "list_steps": "ckptstore.tiers.read",
    "read_manifest": "ckptstore.tiers.read",
    "restore": "ckptstore.tiers.read",
    "SaveResult": "ckptstore.checkpoint.save",
    "save": "ckptstore.checkpoint.save",
    "VerifyReport": "ckptstore.checkpoint.verify",
    "verify": "ckptstore.tiers.read",
    "export_orbax": "ckptstore.orbax.exporter",
    "export_orbax_sync": "ckptstore.orbax.exporter",
    "import_orbax": "ckptstore.orbax.importer",
    "import_orbax_sync": "ckptstore.orbax.importer",
    "policies": "ckptstore.lifecycle.policies",  # a module
    "CheckpointManager": "ckptstore.lifecycle.manager",
    "SaveHandle": "ckptstore.lifecycle.manager",
    "SaveStats": "ckptstore.lifecycle.manager",
    "ManagerOptions": "ckptstore.lifecycle.options",
    "Promotion": "ckptstore.tiers.promote",
    "promote": "ckptstore.tiers.promote",
    "promote_sync": "ckptstore.tiers.promote",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value: Any = loaded if name == "policies" else getattr(loaded, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AlreadyExistsError",
    "Backend",
    "Capabilities",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CkptStoreError",
    "ConfigError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DuplicateLeafError",
    "FencedError",
    "IncompleteCheckpointError",
    "InsufficientMemoryError",
    "InsufficientSpaceError",
    "InvalidKeyError",
    "InvalidStepError",
    "InvalidURLError",
    "ManagerOptions",
    "NotFoundError",
    "ObjectChangedError",
    "ObjectInfo",
    "Part",
    "PartialSave",
    "PartialSaveSync",
    "PermissionDeniedError",
    "Promotion",
    "Removal",
    "RetriesExhaustedError",
    "RetryPolicy",
    "SaveHandle",
    "SaveResult",
    "SaveStats",
    "StorageError",
    "Tiered",
    "TransientStorageError",
    "TreeMismatchError",
    "UnsupportedOperationError",
    "VerifyReport",
    "delete_step",
    "delete_step_sync",
    "export_orbax",
    "export_orbax_sync",
    "gc",
    "gc_sync",
    "import_orbax",
    "import_orbax_sync",
    "list_steps",
    "list_steps_sync",
    "load_profile",
    "open_backend",
    "partial_save",
    "partial_save_sync",
    "policies",
    "promote",
    "promote_sync",
    "read_manifest",
    "read_manifest_sync",
    "restore",
    "restore_sync",
    "save",
    "save_sync",
    "verify",
    "verify_sync",
]
