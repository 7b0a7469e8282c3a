"""Orbax's names on ckptstore's `CheckpointManager` (which inherits `OrbaxCompat`).

The methods an Orbax `CheckpointManager` user reaches for, with Orbax 0.12's meanings:
`metrics`, `best_step`, `should_save`, `delete`, `reload`, `metadata`, `item_metadata`,
`directory`, `is_saving_in_progress` and `check_for_errors`. Each is a thin layer over the
manager's parts (`Retention`, `OrbaxRoot`) and `ckptstore.api`; on an Orbax root
(`ckptstore.lifecycle.orbaxroot`) `metrics` and `best_step` are the Orbax steps' own.
docs/migrating-from-orbax.md maps one API onto the other.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptstore.api import delete_step, read_manifest
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.errors import CheckpointNotFoundError, UnsupportedOperationError
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.format.tree import rebuild
from ckptstore.lifecycle import policies as P
from ckptstore.lifecycle.options import ManagerOptions
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.target import Tiered

if TYPE_CHECKING:
    from ckptstore.lifecycle.handles import SaveHandle
    from ckptstore.lifecycle.orbaxroot import OrbaxRoot
    from ckptstore.lifecycle.retention import Retention

T = TypeVar("T")


@dataclass(frozen=True)
class StepMetadata:
    """What a committed step holds besides its arrays' bytes (`OrbaxCompat.metadata`).

    ``item_metadata``: per item, the saved tree with a `LeafInfo` (shape, dtype, kind,
    sharding) for each array leaf, or a configuration item's JSON value. ``custom_metadata``:
    what ``save(metadata=...)`` was given; ``metrics``: its ``metrics=``; ``created``: when
    the manifest was written (seconds since the epoch); ``manifest``: all the rest.
    """

    step: int
    item_metadata: dict[str, Any]
    custom_metadata: dict[str, Any]
    metrics: dict[str, Any]
    created: float
    manifest: Manifest


class OrbaxCompat:
    """Orbax's names on `CheckpointManager` (see the module docstring)."""

    if TYPE_CHECKING:  # what the manager provides
        backend: Backend
        durable: Backend | None
        keep_policy: P.KeepPolicy
        options: ManagerOptions
        _inflight: SaveHandle | None
        _retention: Retention
        _orbax: OrbaxRoot
        _records: dict[int, P.StepRecord]
        _last_step: int | None

        def _call(self, coro: Coroutine[Any, Any, T]) -> T: ...
        def _metadata(self, step: int) -> dict[str, Any]: ...
        def latest_step(self) -> int | None: ...
        def _target(self) -> Backend | Tiered: ...
        async def _committed_steps(self) -> list[int]: ...
        def _policy_says(self, step: int, force: bool) -> tuple[bool, bool]: ...
        def _raise_unobserved(self) -> None: ...

    @property
    def directory(self) -> Path | str:
        """Where the run's steps live (Orbax's ``directory``): a `Path` on local disk, else
        the URL; on tiers the durable tier's, whose steps the keep policy governs."""
        backend = self.durable or self.backend
        return backend.root if isinstance(backend, LocalBackend) else backend.url

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with ``step`` (``save(metrics=...)``; {} where none were). On
        an Orbax root, what Orbax's ``metrics(step)`` reads: the step's ``metrics`` item."""
        if self._orbax.steps:
            return self._call(self._orbax.record(layout.check_step(step))).metrics
        metrics = self._metadata(step).get("metrics", {})
        return dict(metrics) if isinstance(metrics, dict) else {}

    def best_step(self) -> int | None:
        """The committed step the keep policy's `KeepBest` ranks first by its metric (the
        first `KeepBest` inside `KeepAnyOf`), as Orbax's ranks by ``best_fn``; None when no
        step has that metric. Without a `KeepBest` (Orbax: without ``best_fn``), the latest
        step. Ties go as `KeepBest` breaks them, so the best step is one it keeps. On an
        Orbax root, ranked by the Orbax steps' metrics."""
        best = _keep_best(self.keep_policy)
        if best is None:
            return self.latest_step()
        if self._orbax.steps:
            records = self._call(self._orbax.records())
        else:
            records = self._call(self._retention.step_records(self.durable or self.backend))
        ranked = best.ranked(records)
        return ranked[0] if ranked else None

    def should_save(self, step: int) -> bool:
        """Whether `save` would save ``step`` now (its save policy, and ``if_busy="skip"``
        with a save in flight), without saving or changing anything. On an Orbax root it
        raises what `save` raises: a loop gated on it would otherwise never save, silently.
        With several processes and a clock-dependent policy `save` follows process 0,
        whose answer may differ from this process's."""
        self._orbax.refuse()
        return self._policy_says(layout.check_step(step), False)[1]

    def delete(self, step: int) -> None:
        """Delete committed ``step`` now through the keep policy's path (on tiers from both,
        the fast tier first, so that no promotion brings it back); every process calls it,
        process 0 deletes. Unlike the keep policy it may delete the latest step.
        `CheckpointNotFoundError` naming the committed steps if ``step`` is not one."""
        step = layout.check_step(step)
        if self._orbax.steps:
            raise UnsupportedOperationError(
                f"{self.backend.url} is an Orbax CheckpointManager root: the manager reads "
                "its steps but never changes them (delete them with Orbax)"
            )

        async def drop() -> None:
            steps = await self._committed_steps()
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"step {step} is not committed, so not deleted; committed steps: {steps}",
                    backend=self.backend.url,
                )
            await delete_step(self._target(), step)
            self._records.pop(step, None)

        self._call(Handoff(f"manager/delete/{step}", self.options.timeout).primary(drop))

    def reload(self) -> None:
        """Read the run from storage again after someone else changed it (`ckptstore rm`,
        another job), as Orbax's ``reload``: forget the metrics cached for the keep policy
        and `best_step`, tell an Orbax root again, and (no save in flight) count the save
        policy from the latest step found. Listings always read storage."""
        idle = self._inflight is None or self._inflight.done()
        self._call(self._reload(idle))

    async def _reload(self, idle: bool) -> None:
        """On the manager's loop, where its saves and keep policy use ``_records`` too."""
        self._records.clear()
        committed = await self._committed_steps()
        await self._orbax.look(committed)
        if idle:
            steps = committed or self._orbax.steps
            self._last_step = steps[-1] if steps else None

    def metadata(self, step: int) -> StepMetadata:
        """What committed ``step`` holds (Orbax's ``metadata(step)``): its manifest, which
        ``ckptstore info`` shows, read from the nearest good copy; no array is read."""
        step = layout.check_step(step)
        if step in self._orbax.steps:
            raise UnsupportedOperationError(
                f"step {step} of {self.backend.url} is an Orbax step, which has no ckptstore "
                f"manifest: `ckptstore info {self.backend.url} --step {step}` lists its leaves"
            )
        manifest = self._call(read_manifest(self._target(), step))
        items: dict[str, Any] = {
            name: rebuild(item.structure, item.leaves.__getitem__)
            for name, item in manifest.items.items()
        }
        items |= {name: json.value for name, json in manifest.json_items.items()}
        custom = {k: v for k, v in manifest.metadata.items() if k != "metrics"}
        metrics = manifest.metadata.get("metrics", {})
        metrics = dict(metrics) if isinstance(metrics, dict) else {}
        return StepMetadata(step, items, custom, metrics, manifest.created, manifest)

    def item_metadata(self, step: int, item: str | None = None) -> Any:
        """The saved tree of ``item`` (the manager's item by default) in committed ``step``,
        a `LeafInfo` for each array leaf (a configuration item: its JSON), as Orbax's
        ``item_metadata``: what to build a ``like=`` from. `CheckpointNotFoundError`
        naming the step's items if it has no such item."""
        name = item or self.options.item
        items = self.metadata(step).item_metadata
        if name not in items:
            raise CheckpointNotFoundError(
                f"step {step} has no item {name!r} (it has {sorted(items)})",
                backend=self.backend.url,
            )
        return items[name]

    def is_saving_in_progress(self) -> bool:
        """Whether a save is still running: its write and commit, then (as Orbax's
        finalization) its promotion on tiers and the keep policy."""
        handle = self._inflight
        return (handle is not None and not handle.done()) or self._retention.busy()

    def check_for_errors(self) -> None:
        """Raise the failure of a background save (or of its keep policy or promotion)
        that nobody has seen yet, once, without waiting for anything still running."""
        self._raise_unobserved()
        self._retention.raise_error()


def _keep_best(policy: P.KeepPolicy) -> P.KeepBest | None:
    """``policy`` if it is a `KeepBest`, else the first one inside a `KeepAnyOf`."""
    if isinstance(policy, P.KeepBest):
        return policy
    if isinstance(policy, P.KeepAnyOf):
        for inner in policy.policies:
            if (found := _keep_best(inner)) is not None:
                return found
    return None
