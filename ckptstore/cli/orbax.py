"""The ``ckptstore`` command's Orbax side: ``export-orbax``, ``import-orbax``, and what
``ls``, ``info`` and ``verify`` say about an Orbax checkpoint or `CheckpointManager` root
(`ckptstore.cli.main` calls `ls`, `info` and `verify` when a target holds no committed step).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ckptstore.api.orbax import export_orbax, import_orbax, import_orbax_steps
from ckptstore.checkpoint.target import Target, opened
from ckptstore.cli.output import Output, print_json
from ckptstore.cli.storing import add_storing_options
from ckptstore.cli.text import human
from ckptstore.errors import ConfigError
from ckptstore.format.leaves import LeafInfo
from ckptstore.orbax.importer import DEFAULT_BATCH_BYTES, OrbaxImportResult
from ckptstore.orbax.inspect import (
    OrbaxStep,
    OrbaxVerifyReport,
    describe_step,
    find,
    verify_orbax,
)

COMMANDS = ("export-orbax", "import-orbax")


def _leaf_json(info: LeafInfo) -> dict[str, Any]:
    return {"shape": list(info.shape), "dtype": info.dtype, "kind": info.kind, "bytes": info.nbytes}


def _step_json(s: OrbaxStep, leaves: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {"format": "orbax", "step": s.step, "path": s.where or "."}
    if s.error is not None:
        doc["corrupt"] = s.error
        return doc
    doc |= {"bytes": s.nbytes, "leaves": s.leaves, "items": s.names}
    if leaves:
        doc["items"] = {
            name: {n: _leaf_json(i) for n, i in sorted(item.items())}
            for name, item in s.items.items()
        }
        doc["json_items"] = {name: j.value for name, j in s.json_items.items()}
    return doc


async def ls(target: Target, as_json: bool, shown: str | None = None) -> int | None:
    """List an Orbax checkpoint's steps; None if ``target`` holds no Orbax checkpoint."""
    async with opened(target) as backend:
        found = await find(backend)
        steps = [await describe_step(backend, s, w) for s, w in found]
    if not steps:
        return None
    status = 1 if any(s.error for s in steps) else 0
    if as_json:
        print(json.dumps([_step_json(s, False) for s in steps], indent=1))
        return status
    kind = "directory" if steps[0].step is None else "CheckpointManager root"
    print(f"Orbax {kind} (no ckptstore steps): {shown or target}")
    print(f"{'STEP':>10}  {'SIZE':>10}  {'LEAVES':>6}  ITEMS")
    for s in steps:
        step = "-" if s.step is None else str(s.step)
        if s.error is not None:
            print(f"{step:>10}  CORRUPT: {s.error}")
        else:
            print(f"{step:>10}  {human(s.nbytes):>10}  {s.leaves:>6}  {','.join(s.names)}")
    return status


async def info(target: Target, step: int | None, as_json: bool) -> int | None:
    """Describe one Orbax checkpoint (the latest step); None if there is none."""
    async with opened(target) as backend:
        found = await find(backend, step)
        if not found:
            return None
        s = await describe_step(backend, *found[-1])
    if as_json:
        print(json.dumps(_step_json(s, True), indent=1))
        return 1 if s.error else 0
    what = "Orbax checkpoint" if s.step is None else f"Orbax step {s.step}"
    if s.error is not None:
        print(f"{what}: CORRUPT: {s.error}")
        return 1
    print(f"{what}, {human(s.nbytes)}, {s.leaves} leaves")
    for name, leaves in s.items.items():
        print(f"item {name!r}: {len(leaves)} leaves")
        width = max((len(n) for n in leaves), default=4)
        print(f"  {'LEAF':{width}}  {'DTYPE':>12}  {'SHAPE':>18}  {'BYTES':>10}  KIND")
        for leaf in sorted(leaves.values(), key=lambda i: i.name):
            shape = "x".join(map(str, leaf.shape)) or "scalar"
            print(
                f"  {leaf.name:{width}}  {leaf.dtype:>12}  {shape:>18}  "
                f"{human(leaf.nbytes):>10}  {leaf.kind}"
            )
    for name, value in sorted(s.json_items.items()):
        shown = json.dumps(value.value, sort_keys=True)
        print(f"item {name!r}: JSON, {len(shown)} bytes: {shown[:200]}")
    return 0


async def verify(target: Target, step: int | None, as_json: bool) -> int | None:
    """Read every leaf of an Orbax checkpoint; None if there is none."""
    async with opened(target) as backend:
        if not await find(backend, step):
            return None
        report = await verify_orbax(backend, step)
    if as_json:
        print_json(_verify_json(report))
        return 0 if report.ok else 1
    _print_verify(report)
    return 0 if report.ok else 1


def _verify_json(report: OrbaxVerifyReport) -> dict[str, Any]:
    return {
        "format": "orbax",
        "step": report.step,
        "ok": report.ok,
        "leaves": report.leaves,
        "bytes": report.bytes,
        "problems": report.problems,
    }


def _print_verify(report: OrbaxVerifyReport) -> None:
    for what, why in sorted(report.problems.items()):
        print(f"CORRUPT {what}: {why}")
    verdict = "readable" if report.ok else f"CORRUPT ({len(report.problems)} problem(s))"
    where = "Orbax checkpoint" if report.step is None else f"Orbax step {report.step}"
    print(
        f"{where}: {verdict}; {report.leaves} leaves, {human(report.bytes)} read "
        "(Orbax zarr v2 chunks carry no checksum)"
    )


async def verify_all(target: Target, out: Output) -> int | None:
    """``verify --all`` of an Orbax checkpoint: every finalized step (or the one
    checkpoint of a directory); None if there is none. Exit 1 if any step is corrupt."""
    async with opened(target) as backend:
        found = await find(backend)
        if not found:
            return None
        reports = [await verify_orbax(backend, step) for step, _ in found]
    bad = [r.step for r in reports if not r.ok]
    if out.json:
        print_json(
            {
                "ok": not bad,
                "summary": {
                    "steps": len(reports),
                    "intact": len(reports) - len(bad),
                    "corrupt": bad,
                    "bytes": sum(r.bytes for r in reports),
                },
                "steps": [_verify_json(r) for r in reports],
            }
        )
        return 1 if bad else 0
    for report in reports:
        _print_verify(report)
    readable = len(reports) - len(bad)
    print(f"verified {len(reports)} Orbax step(s): {readable} readable, {len(bad)} CORRUPT")
    return 1 if bad else 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``export-orbax`` and ``import-orbax`` subcommands (``common``: the options every
    command takes: --profile, --endpoint, --json, --progress, --no-progress)."""
    text = "write a committed step as an Orbax checkpoint"
    exp = sub.add_parser("export-orbax", help=text, description=text, parents=[common])
    exp.add_argument("src", help="ckptstore target (path, URL or .toml profile)")
    exp.add_argument("dst", help="new Orbax directory (or CheckpointManager root, --manager)")
    exp.add_argument("--step", type=int, help="the step (default: the latest)")
    exp.add_argument(
        "--item",
        help="export only this array item, as one tree (default: every item of the step; "
        "several, or JSON items, as one Orbax Composite step)",
    )
    exp.add_argument(
        "--manager",
        action="store_true",
        help="add the step to a CheckpointManager root DST (its metrics as Orbax's metrics)",
    )
    exp.add_argument("--copy", action="store_true", help="copy data even where links would do")
    exp.add_argument(
        "--no-verify", action="store_true", help="skip reading every leaf back before finishing"
    )
    text = "convert an Orbax checkpoint into a committed step"
    imp = sub.add_parser("import-orbax", help=text, description=text, parents=[common])
    imp.add_argument("src", help="Orbax directory or CheckpointManager root")
    imp.add_argument("dst", help="ckptstore target (path, URL or .toml profile)")
    which = imp.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the Orbax step (default: the latest finalized)")
    which.add_argument(
        "--all-steps",
        action="store_true",
        help="import every finalized step, each under its own number (metrics and all)",
    )
    which.add_argument(
        "--steps",
        type=step_range,
        metavar="FIRST:LAST",
        help="import the finalized steps from FIRST to LAST, both included (20:, :40)",
    )
    imp.add_argument(
        "--item", help="import only this Orbax item (default: every item of the step, one step)"
    )
    imp.add_argument(
        "--as-step", type=int, help="the step to write (default: the Orbax step; one step only)"
    )
    imp.add_argument("--batch-mib", type=int, default=DEFAULT_BATCH_BYTES >> 20)
    add_storing_options(imp)


def step_range(text: str) -> tuple[int | None, int | None]:
    """``--steps FIRST:LAST``: both bounds included, either left out for no bound."""
    first, sep, last = text.partition(":")
    bounds = [
        None if not b else int(b) if b.isascii() and b.isdigit() else -1 for b in (first, last)
    ]
    lo, hi = bounds
    if not sep or -1 in bounds or (lo is not None and hi is not None and lo > hi):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not FIRST:LAST, two steps in order (either may be left out: 20:, :40)"
        )
    return lo, hi


async def run(args: argparse.Namespace) -> int:
    out = Output.from_args(args)
    if args.command == "export-orbax":
        r = await export_orbax(
            args.src,
            args.dst,
            step=args.step,
            item=args.item,
            manager=args.manager,
            link=not args.copy,
            verify=not args.no_verify,
            progress=out.bar("objects", 0),
        )
        if out.json:
            print_json(
                {
                    "step": r.step,
                    "path": r.path,
                    "leaves": r.leaves,
                    "bytes": r.bytes,
                    "linked": r.linked,
                    "copied": r.copied,
                    "copied_bytes": r.copied_bytes,
                    "items": list(r.items),
                    "metrics": r.metrics,
                }
            )
            return 0
        items = f" as a Composite of {', '.join(r.items)}" if r.items else ""
        items += " with its metrics" if r.metrics else ""
        print(
            f"exported step {r.step}{items} ({r.leaves} leaves, {human(r.bytes)}) to {r.path}: "
            f"{r.linked} objects linked, {r.copied} copied ({human(r.copied_bytes)})"
        )
        return 0
    if args.all_steps or args.steps is not None:
        return await _import_steps(args, out)
    result = await import_orbax(
        args.src,
        args.dst,
        step=args.step,
        item=args.item,
        as_step=args.as_step,
        batch_bytes=args.batch_mib << 20,
        progress=out.bar("leaves", 0),
        **args.storing,
    )
    if out.json:
        print_json(_import_json(result))
        return 0
    print(_import_line(result))
    return 0


async def _import_steps(args: argparse.Namespace, out: Output) -> int:
    """``import-orbax --all-steps`` or ``--steps FIRST:LAST``."""
    if args.as_step is not None:
        raise ConfigError(
            "import-orbax: --as-step names the one step written; with --all-steps or --steps "
            "every step keeps its Orbax number"
        )
    first, last = args.steps or (None, None)
    result = await import_orbax_steps(
        args.src,
        args.dst,
        first=first,
        last=last,
        item=args.item,
        batch_bytes=args.batch_mib << 20,
        progress=out.bar("leaves", 0),
        **args.storing,
    )
    if out.json:
        steps = [_import_json(r) for r in result.steps.values()]
        print_json({"source": result.source, "steps": steps, "already": result.already})
        return 0
    for one in result.steps.values():
        print(_import_line(one))
    if result.already:
        print(f"already imported, left as they are: steps {result.already}")
    return 0


def _import_json(result: OrbaxImportResult) -> dict[str, Any]:
    return {
        "step": result.save.step,
        "attempt": result.save.attempt,
        "source": result.source,
        "leaves": result.leaves,
        "skipped": result.skipped,
        "bytes": result.bytes,
        "parts": result.parts,
        "items": result.items,
    }


def _import_line(result: OrbaxImportResult) -> str:
    return (
        f"imported {result.leaves} leaves ({human(result.bytes)}) from {result.source} "
        f"in {result.parts} parts as step {result.save.step} (items "
        f"{', '.join(result.items)}); skipped {result.skipped}"
    )
