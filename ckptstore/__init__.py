"""ckptstore: async-first checkpoint storage for JAX.

The public API on one screen:

- `save`, `restore`, `list_steps` (async) and `save_sync`, `restore_sync`,
  `list_steps_sync`: checkpoints of JAX pytrees, committed atomically.
- `partial_save(target, step)`: a `PartialSave` session (`add` parts, then `finalize`).
- `verify(target, step)`: a `VerifyReport`: would a restore return exactly what was saved?
- `delete_step(target, step)` and `gc(target, older_than=...)`: removing steps and garbage.
- `CheckpointManager(target, save_policy=..., keep_policy=..., options=ManagerOptions(...))`:
  saves from a training loop that pause it only for staging; policies in `ckptstore.policies`.
- `Tiered(fast=..., durable=...)` and `promote(tiered)`: committed steps copied from a fast
  tier to a durable one; `ckptstore.lifecycle.tiers.restore` reads the nearest good copy.
- `open_backend(url | profile=...)`: a `Backend` for local disk, memory, S3 or GCS.
- `Backend`, `ObjectInfo`, `Capabilities`, `RetryPolicy`: the storage protocol.
- The error hierarchy under `CkptStoreError`.
"""

from ckptstore.backends.base import Backend, Capabilities, ObjectInfo
from ckptstore.backends.registry import load_profile, open_backend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.checkpoint.blocking import list_steps_sync, restore_sync, save_sync, verify_sync
from ckptstore.checkpoint.cleanup import Removal, delete_step, gc
from ckptstore.checkpoint.partial import DuplicateLeafError, Part, PartialSave, partial_save
from ckptstore.checkpoint.restore import list_steps, read_manifest, restore
from ckptstore.checkpoint.save import SaveResult, save
from ckptstore.checkpoint.verify import VerifyReport, verify
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    CoordinationError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidKeyError,
    InvalidURLError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
    TreeMismatchError,
)
from ckptstore.lifecycle import policies
from ckptstore.lifecycle.manager import CheckpointManager, SaveHandle, SaveStats
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.lifecycle.tiers import Promotion, Tiered, promote

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
    "IncompleteCheckpointError",
    "InvalidKeyError",
    "InvalidURLError",
    "ManagerOptions",
    "NotFoundError",
    "ObjectInfo",
    "Part",
    "PartialSave",
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
    "VerifyReport",
    "delete_step",
    "gc",
    "list_steps",
    "list_steps_sync",
    "load_profile",
    "open_backend",
    "partial_save",
    "policies",
    "promote",
    "read_manifest",
    "restore",
    "restore_sync",
    "save",
    "save_sync",
    "verify",
    "verify_sync",
]
