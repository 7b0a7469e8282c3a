"""One exception hierarchy for everything ckptstore raises.

Messages name the backend and the key they concern, never a credential.
"""

from __future__ import annotations


class CkptStoreError(Exception):
    """Base class of every error ckptstore raises on purpose."""


class StorageError(CkptStoreError):
    """A storage operation failed.

    ``backend`` is a credential-free description of the backend (its URL) and
    ``key`` the key concerned, when there is one; ``message`` is the text without them
    (for wrapping this error in another without naming them twice).
    """

    def __init__(self, message: str, *, backend: str | None = None, key: str | None = None):
        self.message = message
        self.backend = backend
        self.key = key
        where = []
        if backend is not None:
            where.append(f"backend {backend}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class NotFoundError(StorageError, FileNotFoundError):
    """The key (or prefix) does not exist."""


class AlreadyExistsError(StorageError, FileExistsError):
    """``create`` found the key already present: someone else won."""


class FencedError(AlreadyExistsError):
    """Another actor decided this attempt's fate first (commit protocol v3): it was
    committed, abandoned or garbage-collected by someone else, so this actor stopped before
    writing anything more into it. The message names the fate and when it was decided."""


class PermissionDeniedError(StorageError, PermissionError):
    """The backend refused the operation (credentials, ACLs, read-only media)."""


class InsufficientSpaceError(StorageError, OSError):
    """The storage lacks the space a save needs. Raised before anything is written when a
    local tier's free space is checked first (``needed`` and ``free`` in bytes; ``needed``
    includes the margin the save leaves free), or when a write fails for want of space or
    quota (``ENOSPC``, ``EDQUOT``; both 0: not known). Never transient: retrying cannot
    succeed until space is freed.
    """

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        key: str | None = None,
        needed: int = 0,
        free: int = 0,
    ):
        super().__init__(message, backend=backend, key=key)
        self.needed = needed
        self.free = free


class TransientStorageError(StorageError):
    """A failure that may succeed if retried: throttling, 5xx, timeouts, resets."""


class ObjectChangedError(StorageError):
    """The object was replaced, truncated or removed while it was being read in parts.

    Raised instead of returning bytes of two versions. Not transient on purpose: a
    writer replacing an object that someone reads is worth knowing about; read again
    to get the new version.
    """


class ShortReadError(StorageError):
    """An object holds fewer bytes than a read asked for (`Backend.read_into`). The storage
    layer cannot tell why; a reader of committed data calls it corruption."""


class RetriesExhaustedError(TransientStorageError):
    """A transient failure persisted through every allowed retry."""


class InvalidKeyError(CkptStoreError, ValueError):
    """A key is malformed or would escape the backend's root; raised before any I/O."""


class InvalidURLError(CkptStoreError, ValueError):
    """A backend URL or profile cannot be understood."""


class ConfigError(CkptStoreError, ValueError):
    """Backend options or a profile file are invalid."""


class CredentialsError(PermissionDeniedError, ConfigError):
    """No usable credentials from the source the backend was configured with (none in the
    environment, a profile without keys): the configuration, not the storage, is what to
    fix, so the command line exits 2 for it, not 3."""


class InvalidStepError(CkptStoreError, ValueError):
    """A step is not a non-negative integer (a tree passed where the step goes, say)."""


class CheckpointNotFoundError(NotFoundError):
    """No committed checkpoint matches the request (step, item or leaf)."""


class BaseStepGoneError(CheckpointNotFoundError):
    """The base step an incremental save names (``base=``) is not committed, or stopped
    being committed (deleted or replaced) before the save could commit. Nothing was
    committed and the save's own attempt is abandoned; a save without ``base`` (or with
    another committed base) works. The manager's ``incremental=True`` retries once so."""


class CorruptCheckpointError(CkptStoreError):
    """Stored bytes fail verification: a checksum mismatch, a truncated or missing file."""

    def __init__(self, message: str, *, leaf: str | None = None):
        self.leaf = leaf
        super().__init__(f"{message} (leaf {leaf!r})" if leaf else message)


class IncompleteCheckpointError(CkptStoreError):
    """Validation before commit found leaves without metadata or chunks; nothing committed."""

    def __init__(self, message: str, *, leaves: dict[str, str]):
        self.leaves = leaves
        listed = "; ".join(f"{name}: {why}" for name, why in sorted(leaves.items()))
        super().__init__(f"{message}: {listed}")


class InsufficientMemoryError(CkptStoreError, MemoryError):
    """A read would need a buffer larger than this process can map (its address-space
    limit, or the machine's memory and swap): refused before the buffer is sized, since a
    failed allocation inside TensorStore aborts the process. ``needed`` and ``available``
    in bytes. Restore onto a sharding (``like=`` with shardings) to read slices instead."""

    def __init__(self, message: str, *, needed: int, available: int, leaf: str | None = None):
        self.needed, self.available, self.leaf = needed, available, leaf
        super().__init__(f"{message} (leaf {leaf!r})" if leaf else message)


class TreeMismatchError(CkptStoreError, ValueError):
    """The checkpoint and the requested tree disagree (missing or extra leaves, shapes, dtypes).

    ``problems`` lists every disagreement, one line each.
    """

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"checkpoint does not match the requested tree ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems)
        )


class UnsupportedOperationError(CkptStoreError, NotImplementedError):
    """The operation cannot be done on this target (the message says why and what works
    instead); raised before anything is written."""


class CoordinationError(CkptStoreError):
    """Processes failed to agree in time (a barrier or key-value wait timed out)."""


class TreeError(CkptStoreError, ValueError):
    """A tree cannot be saved or rebuilt as asked."""


class UnsupportedLeafError(CkptStoreError, TypeError):
    """A leaf's type or dtype cannot be stored."""


class DuplicateLeafError(CkptStoreError, ValueError):
    """A part adds leaves an earlier part already holds, without ``replace=True``."""

    def __init__(self, names: list[str]):
        self.names = names
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        super().__init__(f"leaves already saved by an earlier part: {shown} (pass replace=True)")


class StagingBudgetError(CkptStoreError, MemoryError):
    """The state needs more staging memory than the manager may use."""


class OrbaxExportError(CkptStoreError, ValueError):
    """A checkpoint cannot be described to Orbax as asked."""


class SafetensorsError(CkptStoreError, ValueError):
    """A safetensors file, index or mapping rule is malformed."""


def storage_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage itself failed (unreachable, timed out, refused,
    misbehaving), as opposed to an answer about the data: a key that is missing or already
    there, too little room. After such a failure nothing is known about the data."""
    return isinstance(exc, StorageError) and not isinstance(
        exc, NotFoundError | AlreadyExistsError | InsufficientSpaceError
    )


#: Every error a public operation raises (re-exported as ``ckptstore.<name>``).
__all__ = [
    "AlreadyExistsError",
    "BaseStepGoneError",
    "CheckpointNotFoundError",
    "CkptStoreError",
    "ConfigError",
    "CoordinationError",
    "CorruptCheckpointError",
    "CredentialsError",
    "DuplicateLeafError",
    "FencedError",
    "IncompleteCheckpointError",
    "InsufficientMemoryError",
    "InsufficientSpaceError",
    "InvalidKeyError",
    "InvalidStepError",
    "InvalidURLError",
    "NotFoundError",
    "ObjectChangedError",
    "OrbaxExportError",
    "PermissionDeniedError",
    "RetriesExhaustedError",
    "SafetensorsError",
    "ShortReadError",
    "StagingBudgetError",
    "StorageError",
    "TransientStorageError",
    "TreeError",
    "TreeMismatchError",
    "UnsupportedLeafError",
    "UnsupportedOperationError",
]
