"""Changes a caller declares: the rows of a leaf that may differ from the base step.

An incremental save finds the changed chunks of a big leaf by hashing every chunk
(`ckptstore.checkpoint.chunklevel`): of a 256 MiB embedding table of which 2% changed, it
reads all 256 MiB. A training loop often knows better: its sparse optimizer touched some
rows (Check-N-Run, NSDI '22, tracks exactly these). With ``save(..., base=B,
changed={leaf: rows})`` only the chunks holding a declared row are read and hashed, and
written where they differ from B's, in one pass (`ckptstore.datapath.declaredwrites`);
every other chunk of the leaf takes B's recorded digest, is referenced and is never read.
This module checks a declaration (`declared_rows`).

The declaration is trusted, as a `SameObjects` vouching is: a row that changed but is not
declared keeps B's value in the new step, and nothing can tell afterwards (its recorded
digest is B's, of B's bytes). So it is relative to one committed attempt of B: given B as
the `SaveResult` of the save that made it, the save refuses a B committed again since
(`BaseStepGoneError`, as for the manager's base). Leaves not named are compared by their
digests as ever; a named leaf the base did not store in the same form, with chunk digests,
or whose pieces do not lie on chunk boundaries, is hashed whole (the declaration cannot
help there, and is not needed to be right).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptstore.errors import ConfigError

#: Per item, per leaf: the sorted distinct rows (indices on its first axis) that may differ.
Declared = dict[str, dict[str, np.ndarray[Any, np.dtype[np.int64]]]]


def declared_rows(
    shapes: Mapping[str, Mapping[str, tuple[int, ...]]], changed: Any, base: int | None
) -> Declared:
    """``changed`` (per item, ``{leaf name: row indices}``) checked against the items'
    leaf ``shapes`` (per item, per leaf name), its rows as sorted distinct int64 arrays;
    `ConfigError` naming what is wrong (no ``base`` to be relative to, an unknown item or
    leaf, a 0-d leaf, rows that are not integers or lie outside the leaf's first axis)."""
    if base is None:
        raise ConfigError("changed= declares rows changed since a base step: give base= too")
    return checked_rows(shapes, changed)


def checked_rows(shapes: Mapping[str, Mapping[str, tuple[int, ...]]], changed: Any) -> Declared:
    """`declared_rows` of a declaration ``changed``, whatever its base."""
    if not isinstance(changed, Mapping):
        raise ConfigError(f"changed must map items to {{leaf: rows}}, not {type(changed).__name__}")
    out: Declared = {}
    for item, per_leaf in changed.items():
        if item not in shapes:
            raise ConfigError(f"changed names item {item!r}, which is not saved")
        if not isinstance(per_leaf, Mapping):
            raise ConfigError(f"changed[{item!r}] must map leaf names to rows")
        out[item] = {leaf: _rows(leaf, shapes[item], rows) for leaf, rows in per_leaf.items()}
    return out


def _rows(
    leaf: Any, shapes: Mapping[str, tuple[int, ...]], rows: Any
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """One leaf's declared rows, checked (see `declared_rows`)."""
    shape = shapes.get(leaf) if isinstance(leaf, str) else None
    if shape is None:
        some = ", ".join(sorted(shapes)[:8]) + (", ..." if len(shapes) > 8 else "")
        raise ConfigError(f"changed names leaf {leaf!r}, which the tree does not have ({some})")
    if not shape:
        raise ConfigError(f"changed names leaf {leaf!r}, a scalar: it has no rows")
    found = _as_rows(leaf, rows, shape[0])
    if found.size and (found[0] < 0 or found[-1] >= shape[0]):
        bad = found[0] if found[0] < 0 else found[-1]
        raise ConfigError(f"changed[{leaf!r}]: row {bad} is outside 0..{shape[0] - 1}")
    return found


def _as_rows(leaf: Any, rows: Any, count: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``rows`` as sorted distinct int64 row indices: a 1-d sequence or set of integers
    (empty: none), or a boolean mask of the ``count`` rows; `ConfigError` otherwise."""
    if isinstance(rows, (set, frozenset)):
        rows = sorted(rows)
    found = np.asarray(rows)
    if found.dtype == np.bool_ and found.ndim == 1:
        if found.shape[0] != count:
            raise ConfigError(
                f"changed[{leaf!r}]: a boolean mask needs one entry per row ({count}), "
                f"not {found.shape[0]}"
            )
        return np.flatnonzero(found).astype(np.int64)
    if found.size == 0:
        return np.zeros(0, np.int64)
    if found.ndim != 1 or found.dtype.kind not in "iu":
        raise ConfigError(
            f"changed[{leaf!r}] must be a 1-d sequence of integer row indices, a set of "
            f"them or a boolean mask of the rows, not {found.dtype} of shape {found.shape}"
        )
    return np.unique(found.astype(np.int64))
