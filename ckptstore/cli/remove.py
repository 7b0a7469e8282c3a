"""The ``ckptstore`` commands that remove: ``rm`` (steps, ranges, ``--keep-latest``,
``--dry-run``) and ``gc`` (uncommitted attempts and unused parts)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.api import delete_step, gc
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.cleanup import Removal, referenced_elsewhere, scan_step
from ckptstore.cli.output import EXIT_OK, Output, error_json, exit_status, print_json
from ckptstore.cli.steps import committed
from ckptstore.cli.text import count, human
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError
from ckptstore.format import layout
from ckptstore.tiers.target import Tiered


@dataclass(frozen=True)
class StepSpec:
    """One ``rm --step``: a step (``28``, which must be committed) or an inclusive range
    (``10-20``, whichever committed steps lie in it)."""

    first: int
    last: int
    single: bool


def parse_step_spec(text: str) -> StepSpec:
    """An argparse type: ``N`` or ``A-B`` (0 <= A <= B)."""
    first_text, dash, last_text = text.partition("-")
    try:
        first = int(first_text)
        last = int(last_text) if dash else first
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step or a range A-B: {text!r}") from None
    if first < 0 or last < first:
        raise argparse.ArgumentTypeError(f"not a range of steps: {text!r} (A-B, 0 <= A <= B)")
    return StepSpec(first, last, single=not dash)


def positive_int(text: str) -> int:
    """An argparse type: an int of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive number: {text!r}")
    return value


def select_steps(
    present: Sequence[int], specs: Sequence[StepSpec], keep_latest: int | None, shown: str
) -> list[int]:
    """The committed steps ``rm`` removes: those ``specs`` name (a single step that is not
    committed is `CheckpointNotFoundError`, before anything is removed) and, with
    ``keep_latest``, all but the ``keep_latest`` latest."""
    have = set(present)
    missing = sorted({s.first for s in specs if s.single and s.first not in have})
    if missing:
        some = f"step {missing[0]} is" if len(missing) == 1 else f"steps {steps_text(missing)} are"
        raise CheckpointNotFoundError(f"{some} not committed in {shown}; nothing was removed")
    chosen = {s for s in present for spec in specs if spec.first <= s <= spec.last}
    if keep_latest is not None:
        chosen |= set(sorted(present)[: max(0, len(present) - keep_latest)])
    return sorted(chosen)


def steps_text(steps: Sequence[int]) -> str:
    """``1-3, 7``: ascending steps, runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


async def _would_delete(
    target: Backend | Tiered, step: int, deleted: Sequence[int] = ()
) -> Removal:
    """What `delete_step` would remove (a dry run), from the same scan it makes: an
    attempt another step references (one not in ``deleted``, the steps this dry run
    removes before ``step``) or a save in flight does is kept, as `delete_step` keeps it."""

    async def on(backend: Backend) -> Removal | None:
        scanned = await scan_step(backend, step)
        if not scanned.committed:
            return None
        removal = Removal(entries=[layout.commit_key(step, scanned.index)], objects=1)
        keep: set[tuple[int, str]] = set()
        if scanned.marker is not None and scanned.marker.attempt is not None:
            keep = await referenced_elsewhere(backend, step, deleted=deleted)
        for entry in scanned.entries if scanned.marker is not None else []:
            if entry.committed and (step, entry.name) in keep:
                removal.kept_referenced.append(entry.key)
            elif entry.committed:
                removal.add(entry.key, entry.objects)
        return removal

    if isinstance(target, Backend):
        return await on(target) or Removal()
    removal = Removal()
    async with target.opened() as (fast, durable):
        for backend in (fast, durable):
            if (found := await on(backend)) is not None:
                removal.absorb(found, backend.url)
    return removal


async def cmd_rm(
    target: Backend | Tiered,
    shown: str,
    specs: Sequence[StepSpec],
    keep_latest: int | None,
    dry_run: bool,
    out: Output,
) -> int:
    """Remove the selected committed steps, oldest first; stops at the first failure (what
    was removed until then is still reported, then the error: in the JSON document as its
    ``error``, with the exit status that error has). A step another process deleted since
    it was listed is no failure: the goal holds, and the output says so."""
    present = await committed(target)
    steps = select_steps(present, specs, keep_latest, shown)
    done: list[tuple[int, Removal]] = []
    gone: list[int] = []  # deleted by someone else meanwhile
    failure: CkptStoreError | None = None
    bar = out.bar("would remove" if dry_run else "rm", total_items=len(steps))
    try:
        for step in steps:
            try:
                if dry_run:
                    removal = await _would_delete(target, step, [s for s, _ in done])
                else:
                    removal = await delete_step(target, step)
            except CheckpointNotFoundError:
                gone.append(step)
                continue
            except CkptStoreError as exc:
                failure = exc
                break
            done.append((step, removal))
            bar.advance(1, removal.bytes)
    finally:
        bar.close()
    remaining = [s for s in present if s not in {s for s, _ in done} | set(gone)]
    if out.json:
        doc: dict[str, Any] = {
            "dry_run": dry_run,
            "steps": [
                {
                    "step": s,
                    "entries": r.entries,
                    "objects": r.objects,
                    "bytes": r.bytes,
                    "kept_referenced": r.kept_referenced,
                }
                for s, r in done
            ],
            "remaining": remaining,
            "already_removed": gone,
        }
        if failure is None:
            print_json(doc)
            return EXIT_OK
        status = exit_status(failure)
        print_json(doc | error_json(type(failure).__name__, str(failure), status))
        return status
    verb = "would remove" if dry_run else "removed"
    for _, removal in done:
        for key in removal.entries:
            print(f"{verb} {key}")
        for key in removal.kept_referenced:
            print(f"{'would keep' if dry_run else 'kept'} {key} (a committed step references it)")
    if done:
        removals = [r for _, r in done]
        print(
            f"{verb} {count(len(done), 'step')} ({steps_text([s for s, _ in done])}): "
            f"{count(sum(len(r.entries) for r in removals), 'entry', 'entries')}, "
            f"{count(sum(r.objects for r in removals), 'object')}, "
            f"{human(sum(r.bytes for r in removals))}"
        )
    if gone:
        print(f"{count(len(gone), 'step')} ({steps_text(gone)}) already removed by another process")
    if not done and not gone and failure is None:
        print(f"nothing to remove in {shown}")
    stay = "would remain" if dry_run else "remains" if len(remaining) == 1 else "remain"
    listed = f": {steps_text(remaining)}" if remaining else ""
    print(f"{count(len(remaining), 'committed step')} {stay}{listed}")
    if failure is not None:
        raise failure
    return EXIT_OK


async def cmd_gc(target: Backend | Tiered, older_than: float, dry_run: bool, as_json: bool) -> int:
    removal = await gc(target, older_than=older_than, dry_run=dry_run)
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "older_than": older_than,
                "entries": removal.entries,
                "objects": removal.objects,
                "bytes": removal.bytes,
                "kept_young": removal.kept_young,
            }
        )
        return EXIT_OK
    verb = "would remove" if dry_run else "removed"
    for key in removal.entries:
        print(f"{verb} {key}")
    for key in removal.kept_young:
        print(f"kept {key} (written to within the grace period)")
    print(
        f"{verb} {count(len(removal.entries), 'entry', 'entries')}, "
        f"{count(removal.objects, 'object')}, {human(removal.bytes)}"
    )
    return EXIT_OK
