"""The ``ckptstore`` command: what is in a checkpoint, and is it intact.

    ckptstore ls TARGET [--all]          committed steps (--all: uncommitted attempts too;
                                         a [tiers] profile: each step's tiers, promotion lag)
    ckptstore info TARGET [--step N]     the tree: leaves, shapes, dtypes, bytes, shardings
    ckptstore verify TARGET [--step N]   check marker, manifest, coverage and every chunk
    ckptstore rm TARGET --step N         delete one committed step
    ckptstore gc TARGET [--older-than 6h] [--dry-run]
                                         remove uncommitted attempts and unused parts
    ckptstore promote TIERS [--step N]   copy committed steps from the fast tier to the
                                         durable one (TIERS: a profile with a [tiers] table)
    ckptstore import-safetensors SRC DST [--step N] [--map RULES]
                                         stream a safetensors model into a checkpoint

TARGET is a path, a URL (s3://, gs://, file://) or a ``.toml`` profile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ckptstore.backends.registry import load_profile
from ckptstore.checkpoint.cleanup import DEFAULT_GRACE, Removal, delete_step, gc, scan
from ckptstore.checkpoint.commit import committed_steps, latest_manifest, load_committed
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.checkpoint.target import opened
from ckptstore.checkpoint.verify import verify
from ckptstore.errors import CkptStoreError, ConfigError, CorruptCheckpointError
from ckptstore.importers.safetensors import import_safetensors
from ckptstore.lifecycle.options import seconds
from ckptstore.lifecycle.tiers import Tiered, promote, status


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


async def cmd_ls(target: str, as_json: bool, show_all: bool) -> int:
    if target.endswith(".toml") and os.path.isfile(target) and "tiers" in load_profile(target):
        return await cmd_ls_tiers(target, as_json)
    if show_all:
        return await cmd_ls_all(target, as_json)
    async with opened(target) as backend:
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
                    "created": m.created,
                    "items": sorted(m.items),
                    "leaves": sum(len(i.leaves) for i in m.items.values()),
                }
            )
    status = 1 if any("corrupt" in r for r in rows) else 0
    if as_json:
        print(json.dumps(rows, indent=1))
        return status
    if not rows:
        print(f"no committed checkpoints in {target}")
        return 0
    print(f"{'STEP':>10}  {'SIZE':>10}  {'LEAVES':>6}  {'CREATED':19}  ITEMS")
    for r in rows:
        if "corrupt" in r:
            print(f"{r['step']:>10}  CORRUPT: {r['corrupt']}")
            continue
        print(
            f"{r['step']:>10}  {human(r['bytes']):>10}  {r['leaves']:>6}  "
            f"{when(r['created'])}  {','.join(r['items'])}"
        )
    return status


_TIER_TEXT = {
    "fast": "fast only (not promoted yet)",
    "both": "fast + durable",
    "durable": "durable",
}


async def cmd_ls_tiers(profile: str, as_json: bool) -> int:
    """Each committed step's tiers, and how far promotion lags behind."""
    tiered = Tiered.from_profile(profile)
    where = (await status(tiered)).steps
    lagging = [s for s, w in where.items() if w == "fast"]
    oldest = None
    if lagging:
        async with opened(tiered.fast) as fast:
            oldest = (await load_committed(fast, min(lagging))).created
    if as_json:
        lag = None if oldest is None else time.time() - oldest
        print(json.dumps({"steps": where, "unpromoted": lagging, "lag_seconds": lag}, indent=1))
        return 0
    if not where:
        print(f"no committed checkpoints on either tier of {profile}")
        return 0
    print(f"{'STEP':>10}  TIERS")
    for step, w in where.items():
        print(f"{step:>10}  {_TIER_TEXT[w]}")
    if oldest is None:
        print("promotion lag: none")
    else:
        print(
            f"promotion lag: {len(lagging)} step(s), the oldest saved "
            f"{duration_text(time.time() - oldest)} ago"
        )
    return 0


async def cmd_ls_all(target: str, as_json: bool) -> int:
    """Every entry of every step directory: committed or not, with age and stored size."""
    async with opened(target) as backend:
        scans = await scan(backend)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for s in scans:
        for e in s.entries:
            state = "committed" if e.committed else "uncommitted"
            if s.marker_error is not None:
                state = "unreadable marker"
            idle = e.idle_for(now)
            rows.append(
                {
                    "step": s.step,
                    "entry": e.name,
                    "state": state,
                    "bytes": e.bytes,
                    "objects": len(e.objects),
                    "idle_seconds": idle,
                }
            )
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"nothing stored in {target}")
        return 0
    print(f"{'STEP':>10}  {'STATE':11}  {'SIZE':>10}  {'IDLE':>8}  ENTRY")
    for r in rows:
        age = "?" if r["idle_seconds"] is None else duration_text(r["idle_seconds"])
        print(f"{r['step']:>10}  {r['state']:11}  {human(r['bytes']):>10}  {age:>8}  {r['entry']}")
    return 0


def _sharding_text(sharding: dict[str, Any] | None) -> str:
    if not sharding:
        return "-"
    if sharding.get("type") == "named":
        mesh = ",".join(f"{k}={v}" for k, v in sharding["mesh"].items())
        return f"P{tuple(sharding['spec'])} mesh({mesh})"
    return str(sharding.get("type"))


def _print_info(manifest: Manifest) -> None:
    print(f"step {manifest.step}, created {when(manifest.created)}, {human(manifest.nbytes)}")
    if manifest.attempt:
        print(f"  attempt {manifest.attempt}")
    if manifest.timings:
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in manifest.timings.items())
        print(f"  timings: {phases}")
    for p in manifest.processes:
        print(
            f"  process {p.get('process')}: wrote {human(p.get('bytes', 0))} in "
            f"{p.get('shards', 0)} shards, {p.get('seconds', 0):.2f} s"
        )
    for name, item in manifest.items.items():
        print(f"item {name!r}: {len(item.leaves)} leaves, {human(item.nbytes)}")
        width = max((len(n) for n in item.leaves), default=4)
        print(f"  {'LEAF':{width}}  {'DTYPE':>12}  {'SHAPE':>18}  {'BYTES':>10}  SHARDING")
        for leaf in sorted(item.leaves.values(), key=lambda i: i.name):
            shape = "x".join(map(str, leaf.shape)) or "scalar"
            print(
                f"  {leaf.name:{width}}  {leaf.dtype:>12}  {shape:>18}  "
                f"{human(leaf.nbytes):>10}  {_sharding_text(leaf.sharding)}"
            )


async def cmd_info(target: str, step: int | None, as_json: bool) -> int:
    async with opened(target) as backend:
        manifest = await latest_manifest(backend, step)
    if as_json:
        print(manifest.to_bytes().decode())
    else:
        _print_info(manifest)
    return 0


async def cmd_verify(target: str, step: int | None, as_json: bool) -> int:
    """Exit 0 only if a restore of the step would return exactly what was saved."""
    report = await verify(target, step)
    if as_json:
        doc = {
            "step": report.step,
            "attempt": report.attempt,
            "ok": report.ok,
            "leaves": report.leaves,
            "bytes": report.bytes,
            "problems": report.problems,
        }
        print(json.dumps(doc, indent=1))
        return 0 if report.ok else 1
    for what, why in sorted(report.problems.items()):
        print(f"CORRUPT {what}: {why}")
    bad = len(report.problems)
    verdict = "intact" if report.ok else f"CORRUPT ({bad} problem(s))"
    print(
        f"step {report.step}: {verdict}; {report.leaves} leaves, "
        f"{human(report.bytes)} read and checksummed"
    )
    return 0 if report.ok else 1


def _print_removal(removal: Removal, verb: str) -> None:
    for key in removal.entries:
        print(f"{verb} {key}")
    for key in removal.kept_young:
        print(f"kept {key} (written to within the grace period)")
    print(
        f"{verb} {len(removal.entries)} entries, {removal.objects} objects, {human(removal.bytes)}"
    )


async def cmd_promote(profile: str, step: int | None, show_progress: bool) -> int:
    tiered = Tiered.from_profile(profile)

    def progress(done: int, total: int) -> None:
        if show_progress:
            print(f"\r  {human(done)} of {human(total)}", end="", file=sys.stderr, flush=True)

    for p in await promote(tiered, step, progress=progress):
        if show_progress and p.copied:
            print(file=sys.stderr)
        what = (
            "already durable"
            if p.already
            else (
                f"copied {p.copied} of {p.objects} objects, {human(p.bytes)} in {p.seconds:.1f} s"
            )
        )
        print(f"step {p.step}: {what}")
    where = (await status(tiered)).steps
    print(f"durable now: {sorted(s for s, w in where.items() if w != 'fast')}")
    return 0


async def cmd_rm(target: str, step: int) -> int:
    _print_removal(await delete_step(target, step), "removed")
    return 0


async def cmd_gc(target: str, older_than: float, dry_run: bool) -> int:
    removal = await gc(target, older_than=older_than, dry_run=dry_run)
    _print_removal(removal, "would remove" if dry_run else "removed")
    return 0


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``6h`` or ``2d`` as seconds."""
    try:
        return seconds(text, what="--older-than")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


async def cmd_import(args: argparse.Namespace) -> int:
    result = await import_safetensors(
        args.src,
        args.dst,
        step=args.step,
        rules=args.map,
        batch_bytes=args.batch_mib << 20,
        progress=not args.no_progress,
    )
    print(
        f"imported {result.tensors} tensors ({human(result.bytes)}) in {result.parts} parts "
        f"as step {result.save.step}; skipped {result.skipped}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstore", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list committed steps")
    ls.add_argument("target")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("--all", action="store_true", help="uncommitted attempts too, with age")
    info = sub.add_parser("info", help="describe one step's tree (latest by default)")
    info.add_argument("target")
    info.add_argument("--step", type=int)
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    verify = sub.add_parser("verify", help="read every chunk and check its checksum")
    verify.add_argument("target")
    verify.add_argument("--step", type=int)
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    rm = sub.add_parser("rm", help="delete one committed step (its marker first)")
    rm.add_argument("target")
    rm.add_argument("--step", type=int, required=True)
    collect = sub.add_parser("gc", help="remove uncommitted attempts and unused parts")
    collect.add_argument("target")
    collect.add_argument(
        "--older-than",
        type=parse_duration,
        default=DEFAULT_GRACE,
        help="only what nobody wrote to for this long (default 6h; 0 = regardless of age)",
    )
    collect.add_argument("--dry-run", action="store_true", help="show, remove nothing")
    prom = sub.add_parser("promote", help="copy committed steps from the fast to the durable tier")
    prom.add_argument("tiers", help="a .toml profile with a [tiers] table (fast, durable)")
    prom.add_argument("--step", type=int, help="only this step (default: every unpromoted one)")
    prom.add_argument("--no-progress", action="store_true")
    imp = sub.add_parser("import-safetensors", help="stream a safetensors model into a checkpoint")
    imp.add_argument("src", help="a .safetensors file, a model folder, or its index.json")
    imp.add_argument("dst", help="checkpoint target (path, URL or .toml profile)")
    imp.add_argument("--step", type=int, default=0)
    imp.add_argument("--map", help="TOML rule file: renames, transposes, dtype casts")
    imp.add_argument("--batch-mib", type=int, default=256, help="tensor bytes per part")
    imp.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "ls":
            return asyncio.run(cmd_ls(args.target, args.json, args.all))
        if args.command == "info":
            return asyncio.run(cmd_info(args.target, args.step, args.json))
        if args.command == "import-safetensors":
            return asyncio.run(cmd_import(args))
        if args.command == "rm":
            return asyncio.run(cmd_rm(args.target, args.step))
        if args.command == "promote":
            return asyncio.run(cmd_promote(args.tiers, args.step, not args.no_progress))
        if args.command == "gc":
            return asyncio.run(cmd_gc(args.target, args.older_than, args.dry_run))
        return asyncio.run(cmd_verify(args.target, args.step, args.json))
    except CkptStoreError as exc:
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
