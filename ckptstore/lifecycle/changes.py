"""Rows a training loop declares changed, call by call, for the manager's incremental saves.

``manager.save(step, state, changed={leaf: rows})`` on every step names the rows that step's
update touched (a sparse optimizer knows them), whether or not the save policy saves the
step. A save then declares, per leaf, the union of the rows of every call since the call
that made its base (`ckptstore.checkpoint.declared`: only the chunks holding them are
hashed). Which calls those are depends on how earlier saves ended, which the manager knows
only later, so the rows are kept in periods:

- ``now``: the calls since the last save took a declaration;
- ``taken``: the period the save in flight declared, kept until its outcome is known. When
  the next save's base is that save's step, it committed and the period is dropped; when
  it is not (the save failed), the period is joined to ``now``.

A leaf is declared only if every call of the period named it (one call that did not, and
the manager cannot tell what that step changed): otherwise it is hashed as ever, as it is
when the base is a step this manager did not save (its attempt unknown, so nothing pins
what the rows are relative to).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ckptstore.checkpoint.declared import Declared, checked_rows
from ckptstore.format.tree import flatten

Key = tuple[str, str]  # (item, leaf)


@dataclass
class _Period:
    """The calls of one period: how many, and per leaf its rows and how many named it."""

    calls: int = 0
    rows: dict[Key, list[np.ndarray[Any, np.dtype[np.int64]]]] = field(default_factory=dict)
    named: dict[Key, int] = field(default_factory=dict)

    def joined(self, later: _Period) -> _Period:
        out = _Period(self.calls + later.calls)
        for key in self.rows.keys() | later.rows.keys():
            out.rows[key] = self.rows.get(key, []) + later.rows.get(key, [])
            out.named[key] = self.named.get(key, 0) + later.named.get(key, 0)
        return out

    def declared(self) -> Declared:
        """Per item, the leaves every call named, with the union of their rows."""
        out: Declared = {}
        for (item, leaf), parts in self.rows.items():
            if self.named[(item, leaf)] == self.calls:
                out.setdefault(item, {})[leaf] = np.unique(np.concatenate(parts))
        return out


class _LeafShapes(Mapping[str, tuple[int, ...]]):
    """A tree's leaf shapes by leaf name, each found when asked for."""

    def __init__(self, places: Mapping[str, int], leaves: Sequence[Any]) -> None:
        self._places, self._leaves = places, leaves

    def __getitem__(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self._leaves[self._places[name]]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._places)

    def __len__(self) -> int:
        return len(self._places)


class ChangedRows:
    """The manager's record of declared rows (see the module docstring)."""

    def __init__(self) -> None:
        self._now = _Period()
        self._taken: tuple[int, _Period] | None = None
        #: Per item, its tree's structure and each leaf name's place among its leaves.
        self._places: dict[str, tuple[Any, dict[str, int]]] = {}

    def _shapes(self, item: str, tree: Any) -> Mapping[str, tuple[int, ...]]:
        """The shapes of ``tree``'s leaves by name, looked up as asked: a call names a few
        leaves of thousands, and naming them all (`flatten`) on every training step cost
        ~8 ms for 1,000 leaves; the names are made again only when the structure changes."""
        leaves, structure = jax.tree_util.tree_flatten(tree)
        known = self._places.get(item)
        if known is None or known[0] != structure:
            places = {name: k for k, (name, _) in enumerate(flatten(tree))}
            known = self._places[item] = (structure, places)
        return _LeafShapes(known[1], leaves)

    def add(self, changed: Mapping[str, Any] | None, item: str | None, trees: Any) -> None:
        """One call of the manager's ``save`` (saving or not) and its declaration (None:
        nothing declared): ``{leaf: rows}`` of ``item``, or with ``item`` None ``{item:
        {leaf: rows}}``, checked against ``trees`` (per item) first: `ConfigError` naming
        a leaf or item they lack, or rows that are not indices (a list, an array, a set)
        or a mask of the leaf's first axis, or lie outside it (then nothing of the call
        is kept)."""
        if changed is not None and item is not None:
            changed = {item: changed}
        found: Declared = {}
        if changed is not None:
            named = changed.keys() if isinstance(changed, Mapping) else ()
            shapes = {name: self._shapes(name, trees[name]) for name in named if name in trees}
            found = checked_rows(shapes, changed)
        self._now.calls += 1
        for name, per_leaf in found.items():
            for leaf, rows in per_leaf.items():
                self._now.rows.setdefault((name, leaf), []).append(rows)
                self._now.named[(name, leaf)] = self._now.named.get((name, leaf), 0) + 1

    def take(self, step: int, base: int | None) -> Declared:
        """The declaration of the save of ``step`` whose base is ``base`` (every call since
        the call that saved ``base``, as far as this record reaches); a new period starts."""
        if self._taken is not None:
            taken_step, taken = self._taken
            if taken_step != base:  # that save did not commit: its rows still count
                self._now = taken.joined(self._now)
        declared = self._now.declared()
        self._taken, self._now = (step, self._now), _Period()
        return declared

    def for_save(self, step: int, base: int | None, pinned: bool) -> Declared | None:
        """`take`, then what the save of ``step`` declares: nothing unless ``base`` is a
        step this manager saved (``pinned``: its attempt known) and some leaf was named in
        every call since."""
        declared = self.take(step, base)
        return declared if base is not None and pinned and declared else None
