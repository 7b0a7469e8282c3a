"""The ``ckptstore`` commands that look at steps: ``ls`` (``--all``), ``info`` and ``verify``
(one step, or ``--all``). Each prints text, or one JSON document with ``--json``, and
returns its exit status (`ckptstore.cli.output`)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ckptstore.api import read_manifest, verify
from ckptstore.backends.base import Backend
from ckptstore.checkpoint.cleanup import idle_seconds, scan
from ckptstore.checkpoint.sizes import stored_sizes
from ckptstore.checkpoint.verify import VerifyReport
from ckptstore.cli import orbax as cli_orbax
from ckptstore.cli.output import (
    EXIT_CORRUPT,
    EXIT_OK,
    EXIT_UNREADABLE,
    Output,
    print_json,
)
from ckptstore.cli.text import count, duration_text, human, when
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.codecs import codec_name
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import committed_steps, load_committed, read_marker
from ckptstore.tiers.read import tier_steps
from ckptstore.tiers.target import Tiered


async def committed(target: Backend | Tiered) -> list[int]:
    """Committed ckptstore steps (on tiers: on either tier); never an Orbax root's."""
    if isinstance(target, Tiered):
        async with target.opened() as (fast, durable):
            return await tier_steps(fast, durable)
    return await committed_steps(target)


async def cmd_ls(backend: Backend, shown: str, as_json: bool) -> int:
    steps = await committed_steps(backend)
    loaded = await asyncio.gather(
        *(load_committed(backend, s) for s in steps), return_exceptions=True
    )
    rows: list[dict[str, Any]] = []
    for step, m in zip(steps, loaded, strict=True):
        if isinstance(m, CorruptCheckpointError):  # listed, not fatal: the others are fine
            rows.append({"step": step, "corrupt": str(m)})
        elif isinstance(m, BaseException):
            raise m
        else:
            rows.append(
                {
                    "step": m.step,
                    "attempt": m.attempt,
                    "bytes": m.nbytes,
                    **stored_bytes(m),
                    "references": sorted({r.step for r in m.references}),
                    "created": m.created,
                    "items": m.item_names,  # array items and JSON items
                    "leaves": sum(len(i.leaves) for i in m.items.values()),
                }
            )
    if not rows and (orbax := await cli_orbax.ls(backend, as_json, shown)) is not None:
        return orbax
    status = EXIT_CORRUPT if any("corrupt" in r for r in rows) else EXIT_OK
    if as_json:
        print_json(rows)
        return status
    if not rows:
        print(f"no committed checkpoints in {shown}")
        return EXIT_OK
    print(
        f"{'STEP':>10}  {'SIZE':>10}  {'LEAVES':>6}  {'WRITTEN':>10}  {'REFERENCED':>10}  "
        f"{'CREATED':19}  ITEMS"
    )
    for r in rows:
        if "corrupt" in r:
            print(f"{r['step']:>10}  CORRUPT: {r['corrupt']}")
            continue
        referenced = human(r["bytes_referenced"]) if r["references"] else "-"
        held = f"  (references step {steps_list(r['references'])})" if r["references"] else ""
        print(
            f"{r['step']:>10}  {human(r['bytes']):>10}  {r['leaves']:>6}  "
            f"{human(r['bytes_written']):>10}  {referenced:>10}  "
            f"{when(r['created'])}  {','.join(r['items'])}{held}"
        )
    return status


def stored_bytes(manifest: Manifest) -> dict[str, int]:
    """A step's payload bytes its own attempt holds (``bytes_written``) and those it
    reads from the attempts in its ``references`` (``bytes_referenced``, incremental
    saves: docs/incremental.md)."""
    referenced = sum(item.referenced_bytes for item in manifest.items.values())
    return {"bytes_written": manifest.nbytes - referenced, "bytes_referenced": referenced}


def steps_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


async def cmd_ls_all(backend: Backend, shown: str, as_json: bool) -> int:
    """Every entry of every step directory (`entries`), as text or JSON."""
    rows = await entries(backend)
    if as_json:
        print_json(rows)
    else:
        print_entries(rows, shown)
    return EXIT_OK


async def entries(backend: Backend) -> list[dict[str, Any]]:
    """Every entry of every step directory: committed, uncommitted, or uncommitted but
    referenced by committed steps (the base of incremental saves: never delete it by
    hand), with its age and the bytes it stores (on storage, where `ls`'s SIZE is a
    step's payload)."""
    scans = await scan(backend)
    bases = await _referenced_by(backend, [s.step for s in scans if s.marker is not None])
    now = time.time()
    rows: list[dict[str, Any]] = []
    for s in scans:
        if not s.committed and s.records:  # deleted: only its records are left
            rows.append(
                {
                    "step": s.step,
                    "entry": ", ".join(sorted(o.key.rsplit("/", 1)[-1] for o in s.records)),
                    "state": "deleted",
                    "bytes": sum(o.size for o in s.records),
                    "objects": len(s.records),
                    "idle_seconds": idle_seconds(s.records, now),
                    "referenced_by": [],
                }
            )
        for e in s.entries:
            users = bases.get((s.step, e.name), [])
            state = "committed" if e.committed else ("referenced" if users else "uncommitted")
            if s.marker_error is not None:
                state = "unreadable marker"
            rows.append(
                {
                    "step": s.step,
                    "entry": e.name,
                    "state": state,
                    "bytes": e.bytes,
                    "objects": len(e.objects),
                    "idle_seconds": e.idle_for(now),
                    "referenced_by": users,
                }
            )
    return rows


#: What `ls --all` says of a deleted step's directory (where `ls` of the files shows
#: ``<step>/REVOKED.<n>``): not damage, and never to be removed by hand.
DELETED_NOTE = (
    "the step was deleted; these records stay so that a delete decided on an older "
    "listing can never remove a later save of this step"
)


def print_entries(rows: list[dict[str, Any]], shown: str) -> None:
    """`entries` as a table (STORED: bytes on storage)."""
    if not rows:
        print(f"nothing stored in {shown}")
        return
    print(f"{'STEP':>10}  {'STATE':11}  {'STORED':>10}  {'IDLE':>8}  ENTRY")
    for r in rows:
        age = "?" if r["idle_seconds"] is None else duration_text(r["idle_seconds"])
        base = f"  (base of {steps_list(r['referenced_by'])})" if r["referenced_by"] else ""
        if r["state"] == "deleted":
            base = f"  ({DELETED_NOTE})"
        print(
            f"{r['step']:>10}  {r['state']:11}  {human(r['bytes']):>10}  {age:>8}  "
            f"{r['entry']}{base}"
        )


async def _referenced_by(backend: Backend, steps: list[int]) -> dict[tuple[int, str], list[int]]:
    """Per (step, attempt) that committed ``steps`` reference (incremental saves), the
    steps that do. A manifest that cannot be read adds nothing (`ls` reports it)."""
    loaded = await asyncio.gather(
        *(load_committed(backend, s) for s in steps), return_exceptions=True
    )
    out: dict[tuple[int, str], list[int]] = {}
    for step, manifest in zip(steps, loaded, strict=True):
        if isinstance(manifest, BaseException):
            continue
        for holder in manifest.references:
            key = (holder.step, holder.attempt)
            if step not in out.setdefault(key, []):
                out[key].append(step)
    return out


def _sharding_text(sharding: dict[str, Any] | None) -> str:
    if not sharding:
        return "-"
    if sharding.get("type") == "named":
        mesh = ",".join(f"{k}={v}" for k, v in sharding["mesh"].items())
        return f"P{tuple(sharding['spec'])} mesh({mesh})"
    return str(sharding.get("type"))


def _per_process(manifest: Manifest) -> list[str]:
    """One line per writing process, its parts (partial saves, imports) summed."""
    totals: dict[Any, dict[str, float]] = {}
    for p in manifest.processes:
        t = totals.setdefault(p.get("process"), {"bytes": 0, "shards": 0, "seconds": 0, "n": 0})
        t["bytes"] += p.get("bytes", 0)
        t["shards"] += p.get("shards", 0)
        t["seconds"] += p.get("seconds", 0)
        t["n"] += 1
    return [
        f"  process {proc}: wrote {human(t['bytes'])} in {count(int(t['shards']), 'shard')}"
        + (f" ({count(int(t['n']), 'part')})" if t["n"] > 1 else "")
        + f", {t['seconds']:.2f} s"
        for proc, t in totals.items()
    ]


def _print_info(
    manifest: Manifest, after: dict[str, float], sizes: dict[str, dict[str, int | None]]
) -> None:
    print(f"step {manifest.step}, created {when(manifest.created)}, {human(manifest.nbytes)}")
    if manifest.attempt:
        print(f"  attempt {manifest.attempt}")
    stored = stored_bytes(manifest)
    print(
        f"  written {human(stored['bytes_written'])}, "
        f"referenced {human(stored['bytes_referenced'])}"
        + (f" (base step {manifest.base.step})" if manifest.base is not None else "")
    )
    for ref in manifest.references:
        print(f"  references step {ref.step}, attempt {ref.attempt}")
    if manifest.timings or after:
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in {**manifest.timings, **after}.items())
        print(f"  timings: {phases}")
    for line in _per_process(manifest):
        print(line)
    for name, item in manifest.items.items():
        leaves = count(len(item.leaves), "leaf", "leaves")
        print(f"item {name!r}: {leaves}, {human(item.nbytes)}")
        width = max((len(n) for n in item.leaves), default=0)
        width = max(width, len("LEAF"))
        print(
            f"  {'LEAF':{width}}  {'DTYPE':>12}  {'SHAPE':>18}  {'BYTES':>10}  "
            f"{'CODEC':>7}  {'STORED':>10}  SHARDING"
        )
        for leaf in sorted(item.leaves.values(), key=lambda i: i.name):
            shape = "x".join(map(str, leaf.shape)) or "scalar"
            holder = manifest.holder(name, leaf.name)
            held = "" if holder is None else f"  (in step {holder.step})"
            if (part := item.chunk_refs.get(leaf.name)) is not None:  # chunk references
                steps = sorted({manifest.references[j].step for j in part.held})
                held = f"  ({part.count} chunks in steps {', '.join(map(str, steps))})"
            if leaf.cast_from is not None:  # stored narrower, restored as cast_from
                held += f"  (cast from {leaf.cast_from})"
            size = sizes.get(name, {}).get(leaf.name)
            kept = "?" if size is None else human(size)
            print(
                f"  {leaf.name:{width}}  {leaf.dtype:>12}  {shape:>18}  "
                f"{human(leaf.nbytes):>10}  {codec_name(leaf.codec):>7}  {kept:>10}  "
                f"{_sharding_text(leaf.sharding)}{held}"
            )
    for name, json_item in sorted(manifest.json_items.items()):
        kind = f" ({json_item.type})" if json_item.type else ""
        print(f"item {name!r}: JSON{kind}")
        print(f"  {_json_text(json_item.value)}")


def _json_text(value: Any, limit: int = 200) -> str:
    """A JSON item's value on one line, cut at ``limit`` characters."""
    text = json.dumps(value, separators=(", ", ": "), sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def cmd_info(target: Backend | Tiered, step: int | None, as_json: bool) -> int:
    """One step's manifest (on tiers, from the nearest tier with a good copy)."""
    try:
        manifest = await read_manifest(target, step)
    except CheckpointNotFoundError:
        if isinstance(target, Backend):
            if (orbax := await cli_orbax.info(target, step, as_json)) is not None:
                return orbax
        raise
    sizes = await _leaf_sizes(target, manifest)
    if as_json:  # the manifest, and what its attempt holds vs reads from others
        doc = {**json.loads(manifest.to_bytes()), **stored_bytes(manifest)}
        doc["stored"] = {  # per item and leaf: its codec, its chunks' bytes as stored
            item: {
                leaf: {"codec": codec_name(info.codec), "stored_bytes": sizes[item][leaf]}
                for leaf, info in manifest.items[item].leaves.items()
            }
            for item in manifest.items
        }
        print(json.dumps(doc, separators=(",", ":")))
    else:
        _print_info(manifest, await _after_manifest(target, manifest), sizes)
    return EXIT_OK


async def _leaf_sizes(
    target: Backend | Tiered, manifest: Manifest
) -> dict[str, dict[str, int | None]]:
    """Each leaf's stored bytes, measured (`ckptstore.checkpoint.sizes`): on tiers, on the
    fast tier if it holds the step's attempt, else on the durable one. Where they cannot
    be measured (a store this version's index reader does not understand, a tier gone),
    None: `info` shows the manifest all the same."""
    unknown: dict[str, dict[str, int | None]] = {
        item: dict.fromkeys(entry.leaves) for item, entry in manifest.items.items()
    }
    try:
        if isinstance(target, Backend):
            return await stored_sizes(target, manifest)
        async with target.opened() as (fast, durable):
            where = layout.AttemptDir(manifest.step, manifest.attempt).manifest
            for backend in (fast, durable):
                if await backend.exists(where):
                    return await stored_sizes(backend, manifest)
    except CkptStoreError:
        pass
    return unknown


async def _after_manifest(target: Backend | Tiered, manifest: Manifest) -> dict[str, float]:
    """The phases after the manifest was written, which it cannot record: "commit" (from the
    manifest to the marker on the tier the step was saved to, by the marker's time) and, on
    tiers, "promotion" (from that marker to the durable tier's, by when that was stored)."""
    out: dict[str, float] = {}

    async def marker_time(backend: Backend) -> float | None:
        try:
            marker = await read_marker(backend, manifest.step)
        except CorruptCheckpointError:
            return None
        ok = marker is not None and marker.attempt == manifest.attempt and marker.time > 0
        return marker.time if ok and marker is not None else None

    if isinstance(target, Backend):
        committed = await marker_time(target)
    else:
        async with target.opened() as (fast, durable):
            committed = await marker_time(fast)
            if committed is not None and await marker_time(durable) is not None:
                found = await read_marker(durable, manifest.step)
                stored = (await durable.stat(found.key)).mtime if found is not None else None
                if stored is not None:
                    out["promotion"] = max(0.0, stored - committed)
            elif committed is None:  # the fast copy is gone (or the step was never there)
                committed = await marker_time(durable)
    if committed is not None:
        out = {"commit": max(0.0, committed - manifest.created), **out}
    return out


def verify_status(problems: dict[str, str], unreadable: dict[str, str]) -> int:
    """Corrupt data first (a definite answer), then storage that could not be read."""
    return EXIT_CORRUPT if problems else EXIT_UNREADABLE if unreadable else EXIT_OK


def _report_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "step": report.step,
        "attempt": report.attempt,
        "ok": report.ok,
        "leaves": report.leaves,
        "bytes": report.bytes,
        "problems": report.problems,
        "unreadable": report.unreadable,
        "unused": report.unused,
        **({"tier": report.tier, "skipped": report.skipped} if report.tier else {}),
    }


def _verdict(report: VerifyReport) -> str:
    verdict = "intact"
    if report.problems:
        verdict = f"CORRUPT ({count(len(report.problems), 'problem')})"
    elif report.unreadable:
        verdict = f"UNREADABLE ({count(len(report.unreadable), 'part')} could not be read)"
    if report.tier:
        verdict += f" on the {report.tier} tier"
    return verdict


def _print_report(report: VerifyReport) -> None:
    for what, why in sorted(report.skipped.items()):
        print(f"SKIPPED (damaged fast copy) {what}: {why}")
    for what, why in sorted(report.problems.items()):
        print(f"CORRUPT {what}: {why}")
    for what, why in sorted(report.unreadable.items()):
        print(f"UNREADABLE {what}: {why}")
    for what, why in sorted(report.unused.items()):
        print(f"DAMAGED, READ BY NO RESTORE {what}: {why}")
    print(
        f"step {report.step}: {_verdict(report)}; {count(report.leaves, 'leaf', 'leaves')}, "
        f"{human(report.bytes)} read and checksummed"
    )


async def cmd_verify(target: Backend | Tiered, step: int | None, out: Output) -> int:
    """Exit 0 only if a restore of the step would return exactly what was saved (on tiers:
    the copy a restore would read; a damaged fast copy it would skip is shown)."""
    bar = out.bar("verify" if step is None else f"verify step {step}")
    try:
        report = await verify(target, step, progress=bar.update)
    except CheckpointNotFoundError:
        if isinstance(target, Backend):
            if (orbax := await cli_orbax.verify(target, step, out.json)) is not None:
                return orbax
        raise
    finally:
        bar.close()
    if out.json:
        print_json(_report_json(report))
    else:
        _print_report(report)
    return verify_status(report.problems, report.unreadable)


async def cmd_verify_all(target: Backend | Tiered, shown: str, out: Output) -> int:
    """Verify every committed step, oldest first; one line per step (or its problems), a
    summary, and the worst status: 1 if any step is corrupt, else 3 if any could not be
    read, else 0. A step deleted meanwhile is reported as gone, not as a failure."""
    steps = await committed(target)
    if not steps:
        if isinstance(target, Backend):
            if (orbax := await cli_orbax.verify_all(target, out)) is not None:
                return orbax
        raise CheckpointNotFoundError(f"no committed steps in {shown}: nothing to verify")
    sizes = await asyncio.gather(*(_size(target, s) for s in steps))
    total = sum(sizes)
    bar = out.bar(f"verify {count(len(steps), 'step')}", total_bytes=total)
    reports: list[VerifyReport] = []
    gone: list[int] = []
    before = 0  # bytes of the steps already checked
    try:
        for step, size in zip(steps, sizes, strict=True):

            def progress(done: int, _: int, base: int = before) -> None:
                bar.update(base + done, total)

            try:
                report = await verify(target, step, progress=progress)
            except CheckpointNotFoundError:  # deleted (by rm, a keep policy) since listed
                gone.append(step)
                continue
            finally:
                before += size
            reports.append(report)
            if not out.json:
                bar.clear()
                if report.ok:
                    print(f"step {report.step}: {_verdict(report)}, {human(report.bytes)}")
                else:
                    _print_report(report)
    finally:
        bar.close()
    corrupt = [r.step for r in reports if r.problems]
    unreadable = [r.step for r in reports if not r.problems and r.unreadable]
    status = EXIT_CORRUPT if corrupt else EXIT_UNREADABLE if unreadable else EXIT_OK
    summary: dict[str, Any] = {
        "steps": len(steps),
        "intact": len(reports) - len(corrupt) - len(unreadable),
        "corrupt": corrupt,
        "unreadable": unreadable,
        "gone": gone,
        "bytes": sum(r.bytes for r in reports),
    }
    if out.json:
        print_json(
            {
                "ok": status == EXIT_OK,
                "summary": summary,
                "steps": [_report_json(r) for r in reports],
            }
        )
        return status
    for step in gone:
        print(f"step {step}: gone (deleted while verifying)")
    parts = [f"{summary['intact']} intact"]
    if corrupt:
        parts.append(f"{len(corrupt)} CORRUPT ({', '.join(map(str, corrupt))})")
    if unreadable:
        parts.append(f"{len(unreadable)} UNREADABLE ({', '.join(map(str, unreadable))})")
    if gone:
        parts.append(f"{len(gone)} gone")
    print(
        f"verified {count(len(steps), 'step')} in {shown}: {', '.join(parts)}; "
        f"{human(summary['bytes'])} read and checksummed"
    )
    return status


async def _size(target: Backend | Tiered, step: int) -> int:
    """A step's payload bytes, for the progress line (0 when its manifest cannot be read:
    verify reports why)."""
    try:
        return (await read_manifest(target, step)).nbytes
    except CkptStoreError:
        return 0
