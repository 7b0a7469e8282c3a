"""ckptstore: async-first checkpoint storage for JAX.

The public API on one screen:

- `open_backend(url | profile=...)`: a `Backend` for local disk, memory, S3 or GCS.
- `Backend`, `ObjectInfo`, `Capabilities`, `RetryPolicy`: the storage protocol.
- The error hierarchy under `CkptStoreError`.
"""

from ckptstore.backends.base import Backend, Capabilities, ObjectInfo
from ckptstore.backends.registry import load_profile, open_backend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import (
    AlreadyExistsError,
    CkptStoreError,
    ConfigError,
    InvalidKeyError,
    InvalidURLError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
)

__all__ = [
    "AlreadyExistsError",
    "Backend",
    "Capabilities",
    "CkptStoreError",
    "ConfigError",
    "InvalidKeyError",
    "InvalidURLError",
    "NotFoundError",
    "ObjectInfo",
    "PermissionDeniedError",
    "RetriesExhaustedError",
    "RetryPolicy",
    "StorageError",
    "TransientStorageError",
    "load_profile",
    "open_backend",
]
