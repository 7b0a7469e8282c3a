"""Which items an Orbax export writes, under which names, and where the step's metrics go.

Orbax 0.12.8's `CheckpointManager` gives two item names a meaning of their own
(``orbax/checkpoint/checkpoint_manager.py``; its ``RESERVED_ITEM_NAMES`` list is empty, the
names are reserved by use):

- ``metrics`` (``METRIC_ITEM_NAME``): the JSON object ``save(..., metrics=m)`` stores, in
  ``<step>/metrics/metrics`` with a ``JsonCheckpointHandler``; ``metrics(step)``,
  ``best_step()`` and a ``best_fn`` keep policy read it from there, always as JSON;
- ``default`` (``DEFAULT_ITEM_NAME``): a step holding ``default/`` is read as a step of one
  tree, so a Composite restore of a step with other items beside ``default`` fails.

So an export to a `CheckpointManager` root (``manager=True``) writes the step's metrics
(``mgr.save(step, ..., metrics=m)`` in ckptstore) as Orbax's ``metrics``, where Orbax's own
code finds them; a JSON item named ``metrics`` (what ``import-orbax`` made of an Orbax
step's metrics) goes there too. An array item named ``metrics``, or ``default`` beside
other items, is refused (`OrbaxExportError`, before anything is written) rather than
renamed: a renamed item would not be where the user's Orbax code looks for it, and Orbax
would read an array tree under ``metrics`` as the step's metrics. A plain Orbax directory
(``manager=False``, restored with ``CompositeCheckpointHandler``) reserves no name and has
no place for metrics: every item keeps its name there and the metrics are not written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.errors import CheckpointNotFoundError, OrbaxExportError
from ckptstore.format.manifest import Manifest
from ckptstore.orbax.metadata import DEFAULT_ITEM

#: Orbax's item of a `CheckpointManager` step that holds its metrics, and the file in it.
METRICS_ITEM = "metrics"


@dataclass(frozen=True)
class ExportItems:
    """What an export of one step writes."""

    arrays: list[str]  # array items, each an Orbax tree
    jsons: list[str]  # JSON items, each as ``JsonSave`` writes it
    #: Orbax's ``metrics`` item (``manager=True`` only): the step's metrics, or None.
    metrics: dict[str, Any] | None
    #: One directory per item (an Orbax Composite step), else one tree.
    composite: bool


def choose_items(manifest: Manifest, item: str | None, manager: bool, url: str) -> ExportItems:
    """The items to export: ``item`` alone (an array item), or (None) every item of the
    step, as one Orbax Composite step where there are several or any JSON item; with
    ``manager``, the step's metrics as Orbax's ``metrics`` (see the module docstring).
    `CheckpointNotFoundError` for an item the step lacks; `OrbaxExportError` for a JSON
    item named alone (Orbax keeps those beside trees, not as a checkpoint) and for a name
    Orbax's `CheckpointManager` reserves."""
    if item is None:
        arrays, jsons = sorted(manifest.items), sorted(manifest.json_items)
    elif item in manifest.json_items:
        raise OrbaxExportError(
            f"item {item!r} of step {manifest.step} is a JSON item, not arrays: export it with "
            f"the step's other items (no --item: one Orbax Composite step of "
            f"{manifest.item_names}), or restore it with item={item!r}"
        )
    elif item not in manifest.items:
        raise CheckpointNotFoundError(
            f"step {manifest.step} has no item {item!r} (it has {manifest.item_names})",
            backend=url,
        )
    else:
        arrays, jsons = [item], []
    if not manager:
        return ExportItems(arrays, jsons, None, item is None and (len(arrays) != 1 or bool(jsons)))
    metrics = _metrics(manifest, arrays, jsons)
    jsons = [n for n in jsons if n != METRICS_ITEM]
    composite = item is None and (len(arrays) != 1 or bool(jsons))
    if composite and DEFAULT_ITEM in [*arrays, *jsons]:
        raise OrbaxExportError(
            f"step {manifest.step} has an item named {DEFAULT_ITEM!r} beside others "
            f"({manifest.item_names}): Orbax's CheckpointManager reads a step holding "
            f"{DEFAULT_ITEM!r}/ as one tree, and its Composite restore of the others would "
            f"fail. Export without --manager (a directory Orbax restores with "
            f"CompositeCheckpointHandler), or --item {DEFAULT_ITEM}"
        )
    return ExportItems(arrays, jsons, metrics, composite)


def _metrics(manifest: Manifest, arrays: list[str], jsons: list[str]) -> dict[str, Any] | None:
    """What Orbax's ``metrics`` item of the exported step holds: the step's metrics, or a
    JSON item ``metrics`` (an object), which must agree where both are there."""
    if METRICS_ITEM in arrays:
        raise OrbaxExportError(
            f"item {METRICS_ITEM!r} of step {manifest.step} is an array item, and Orbax's "
            f"CheckpointManager keeps the step's metrics (save(metrics=...)) under that name, "
            f"read as JSON by metrics() and best_fn: export without --manager (a directory "
            f"where {METRICS_ITEM!r} is an item like any other), or the other items one "
            f"--item at a time"
        )
    saved = manifest.metadata.get("metrics")
    step_metrics = dict(saved) if isinstance(saved, dict) and saved else None
    if METRICS_ITEM not in jsons:
        return step_metrics
    value = manifest.json_items[METRICS_ITEM].value
    if not isinstance(value, dict):
        raise OrbaxExportError(
            f"JSON item {METRICS_ITEM!r} of step {manifest.step} is a "
            f"{type(value).__name__}, and Orbax's CheckpointManager keeps the step's metrics, "
            f"a JSON object, under that name: export without --manager"
        )
    if step_metrics is not None and step_metrics != value:
        raise OrbaxExportError(
            f"step {manifest.step} has metrics {step_metrics} and a JSON item "
            f"{METRICS_ITEM!r} holding {value}: Orbax's CheckpointManager keeps one of them "
            f"under that name; export without --manager"
        )
    return dict(value)
