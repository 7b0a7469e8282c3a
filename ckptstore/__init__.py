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
  0.12 checkpoint (by reference where possible), and an Orbax checkpoint as a step
  (`import_orbax_steps`: every step of an Orbax run, or a range, metrics and all).
- `Zstd(level)`, `CodecPolicy`: leaves compressed per name (``save(..., codecs=...)``);
  `CastPolicy`: leaves stored in a narrower dtype, only where asked (``casts=...``).
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

from ckptstore import errors as _errors
from ckptstore.errors import *  # noqa: F403  (the error hierarchy: errors.__all__)

#: The public names loaded on first use, by the module that defines them: the one list
#: `__all__` and the lazy loading come from (tests/test_api.py checks the imports below
#: for type checkers say the same).
_PUBLIC = {
    "ckptstore.api": (
        "Promotion",
        "delete_step",
        "delete_step_sync",
        "gc",
        "gc_sync",
        "list_steps",
        "list_steps_sync",
        "partial_save",
        "partial_save_sync",
        "PartialSaveSync",
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
    ),
    "ckptstore.api.orbax": (
        "export_orbax",
        "export_orbax_sync",
        "import_orbax",
        "import_orbax_steps",
        "import_orbax_steps_sync",
        "import_orbax_sync",
    ),
    "ckptstore.backends.base": (
        "Backend",
        "Capabilities",
        "ObjectInfo",
    ),
    "ckptstore.backends.registry": (
        "load_profile",
        "open_backend",
    ),
    "ckptstore.backends.retry": ("RetryPolicy",),
    "ckptstore.checkpoint.cleanup": ("Removal",),
    "ckptstore.checkpoint.partial": ("PartialSave",),
    "ckptstore.checkpoint.parts": ("Part",),
    "ckptstore.checkpoint.save": ("SaveResult",),
    "ckptstore.checkpoint.verify": ("VerifyReport",),
    "ckptstore.format.casts": ("CastPolicy",),
    "ckptstore.format.codecs": ("CodecPolicy", "Zstd"),
    "ckptstore.lifecycle.handles": ("SaveHandle", "SaveStats"),
    "ckptstore.lifecycle.manager": ("CheckpointManager",),
    "ckptstore.lifecycle.options": ("ManagerOptions",),
    "ckptstore.lifecycle.orbaxcompat": ("StepMetadata",),
    "ckptstore.tiers.target": ("Tiered",),
    "ckptstore.lifecycle": ("policies",),  # a module
}

if TYPE_CHECKING:
    from ckptstore.api import (
        PartialSaveSync,
        Promotion,
        delete_step,
        delete_step_sync,
        gc,
        gc_sync,
        list_steps,
        list_steps_sync,
        partial_save,
        partial_save_sync,
        promote,
        promote_sync,
        read_manifest,
        read_manifest_sync,
        restore,
        restore_sync,
        save,
        save_sync,
        verify,
        verify_sync,
    )
    from ckptstore.api.orbax import (
        export_orbax,
        export_orbax_sync,
        import_orbax,
        import_orbax_steps,
        import_orbax_steps_sync,
        import_orbax_sync,
    )
    from ckptstore.backends.base import Backend, Capabilities, ObjectInfo
    from ckptstore.backends.registry import load_profile, open_backend
    from ckptstore.backends.retry import RetryPolicy
    from ckptstore.checkpoint.cleanup import Removal
    from ckptstore.checkpoint.partial import PartialSave
    from ckptstore.checkpoint.parts import Part
    from ckptstore.checkpoint.save import SaveResult
    from ckptstore.checkpoint.verify import VerifyReport
    from ckptstore.format.casts import CastPolicy
    from ckptstore.format.codecs import CodecPolicy, Zstd
    from ckptstore.lifecycle import policies
    from ckptstore.lifecycle.handles import SaveHandle, SaveStats
    from ckptstore.lifecycle.manager import CheckpointManager
    from ckptstore.lifecycle.options import ManagerOptions
    from ckptstore.lifecycle.orbaxcompat import StepMetadata
    from ckptstore.tiers.target import Tiered

_LAZY = {name: module for module, names in _PUBLIC.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value: Any = getattr(loaded, name, None)
    if value is None:  # a submodule (`policies`) not imported yet
        value = importlib.import_module(f"{module}.{name}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    """The public names (`__all__`) and the package's own dunders, not the helpers this
    module imports (``Any``, ``importlib``, ``TYPE_CHECKING``)."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})


__all__ = sorted([*_errors.__all__, *_LAZY])
