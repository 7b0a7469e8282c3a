"""The ``ckptstore`` command: what is in a checkpoint, and is it intact (``ckptstore --help``):
the parser, ``main``, and ``ls``, ``info``, ``verify``, ``rm``, ``gc``, ``import-safetensors``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ckptstore.api import delete_step, gc, read_manifest, verify
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.registry import PROFILE_ENV, load_profile, resolve_profile
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.cleanup import DEFAULT_GRACE, Removal, scan, scan_step
from ckptstore.checkpoint.commit import committed_steps, load_committed, read_marker
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.checkpoint.target import open_target
from ckptstore.cli import orbax as cli_orbax
from ckptstore.cli.text import count, duration_text, human, when
from ckptstore.cli.tiers import cmd_ls_tiers, cmd_promote
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
    storage_failed,
)
from ckptstore.importers.safetensors import DEFAULT_BATCH_BYTES, import_safetensors
from ckptstore.lifecycle.options import seconds
from ckptstore.tiers.read import tier_steps
from ckptstore.tiers.target import Tiered

DESCRIPTION = "What is in a checkpoint, and is it intact; cleanup, promotion and import."

EXAMPLES = f"""\
targets:
  a path or file:///abs/path, s3://bucket/prefix, gs://bucket/prefix, or a .toml
  profile (a backend's URL and options). With --profile, or ${PROFILE_ENV}, the
  target may be omitted. A profile given by name (--profile moto) is read from
  $CKPTSTORE_PROFILES_DIR/NAME.toml (default ~/.config/ckptstore/profiles).

examples:
  ckptstore ls /data/ckpt                      committed steps: size, leaves, date
  ckptstore ls s3://bucket/run --all           uncommitted attempts too, with age
  ckptstore info gs://bucket/run --step 1000   one step's leaves, shapes, shardings
  ckptstore verify run.toml                    read and checksum every chunk
  ckptstore --endpoint http://127.0.0.1:9000 ls s3://bucket/run
                                               an S3-compatible server (MinIO, moto)
  ckptstore --profile moto info                the target is the profile's URL
  ckptstore rm /data/ckpt --step 28 --step 30-40 --dry-run
                                               what removing steps would remove
  ckptstore rm /data/ckpt --keep-latest 3 --json
                                               every committed step but the 3 latest
  ckptstore gc /data/ckpt --older-than 1d --dry-run
  ckptstore promote nvme-s3-tiered.toml        fast tier -> durable tier
  ckptstore promote nvme-s3-tiered.toml --watch --interval 30s
                                               promote each new step, until SIGTERM
  ckptstore import-safetensors model/ /data/ckpt --step 0

exit status:
  0  fine
  1  a checkpoint is corrupt (verify, ls: stored data is wrong)
  2  an error: a missing target, a bad URL or profile, a step that is not committed
  3  the storage failed: unreachable, timed out or refused (permission); for verify,
     some data could not be read, so it is unknown whether it is intact"""

EXIT_OK, EXIT_CORRUPT, EXIT_ERROR, EXIT_UNREADABLE = 0, 1, 2, 3

SIGPIPE_EXIT = 128 + getattr(signal, "SIGPIPE", 13)


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
                    "created": m.created,
                    "items": sorted(m.items),
                    "leaves": sum(len(i.leaves) for i in m.items.values()),
                }
            )
    if not rows and (orbax := await cli_orbax.ls(backend, as_json, shown)) is not None:
        return orbax
    status = 1 if any("corrupt" in r for r in rows) else 0
    if as_json:
        print(json.dumps(rows, indent=1))
        return status
    if not rows:
        print(f"no committed checkpoints in {shown}")
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


async def cmd_ls_all(backend: Backend, shown: str, as_json: bool) -> int:
    """Every entry of every step directory: committed or not, with age and stored size."""
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
        print(f"nothing stored in {shown}")
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


def _print_info(manifest: Manifest, after: dict[str, float]) -> None:
    print(f"step {manifest.step}, created {when(manifest.created)}, {human(manifest.nbytes)}")
    if manifest.attempt:
        print(f"  attempt {manifest.attempt}")
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
        print(f"  {'LEAF':{width}}  {'DTYPE':>12}  {'SHAPE':>18}  {'BYTES':>10}  SHARDING")
        for leaf in sorted(item.leaves.values(), key=lambda i: i.name):
            shape = "x".join(map(str, leaf.shape)) or "scalar"
            print(
                f"  {leaf.name:{width}}  {leaf.dtype:>12}  {shape:>18}  "
                f"{human(leaf.nbytes):>10}  {_sharding_text(leaf.sharding)}"
            )


async def cmd_info(target: Backend | Tiered, step: int | None, as_json: bool) -> int:
    """One step's manifest (on tiers, from the nearest tier with a good copy)."""
    try:
        manifest = await read_manifest(target, step)
    except CheckpointNotFoundError:
        if isinstance(target, Backend):
            if (orbax := await cli_orbax.info(target, step, as_json)) is not None:
                return orbax
        raise
    if as_json:
        print(manifest.to_bytes().decode())
    else:
        _print_info(manifest, await _after_manifest(target, manifest))
    return 0


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
                stored = (await durable.stat(layout.commit_key(manifest.step))).mtime
                if stored is not None:
                    out["promotion"] = max(0.0, stored - committed)
            elif committed is None:  # the fast copy is gone (or the step was never there)
                committed = await marker_time(durable)
    if committed is not None:
        out = {"commit": max(0.0, committed - manifest.created), **out}
    return out


async def cmd_verify(target: Backend | Tiered, step: int | None, as_json: bool) -> int:
    """Exit 0 only if a restore of the step would return exactly what was saved (on tiers:
    the copy a restore would read; a damaged fast copy it would skip is shown)."""
    try:
        report = await verify(target, step)
    except CheckpointNotFoundError:
        if isinstance(target, Backend):
            if (orbax := await cli_orbax.verify(target, step, as_json)) is not None:
                return orbax
        raise
    if as_json:
        doc = {
            "step": report.step,
            "attempt": report.attempt,
            "ok": report.ok,
            "leaves": report.leaves,
            "bytes": report.bytes,
            "problems": report.problems,
            "unreadable": report.unreadable,
            **({"tier": report.tier, "skipped": report.skipped} if report.tier else {}),
        }
        print(json.dumps(doc, indent=1))
        return _verify_status(report.problems, report.unreadable)
    for what, why in sorted(report.skipped.items()):
        print(f"SKIPPED (damaged fast copy) {what}: {why}")
    for what, why in sorted(report.problems.items()):
        print(f"CORRUPT {what}: {why}")
    for what, why in sorted(report.unreadable.items()):
        print(f"UNREADABLE {what}: {why}")
    verdict = "intact"
    if report.problems:
        verdict = f"CORRUPT ({count(len(report.problems), 'problem')})"
    elif report.unreadable:
        verdict = f"UNREADABLE ({count(len(report.unreadable), 'part')} could not be read)"
    if report.tier:
        verdict += f" on the {report.tier} tier"
    print(
        f"step {report.step}: {verdict}; {count(report.leaves, 'leaf', 'leaves')}, "
        f"{human(report.bytes)} read and checksummed"
    )
    return _verify_status(report.problems, report.unreadable)


def _verify_status(problems: dict[str, str], unreadable: dict[str, str]) -> int:
    """Corrupt data first (a definite answer), then storage that could not be read."""
    return EXIT_CORRUPT if problems else EXIT_UNREADABLE if unreadable else EXIT_OK


def _print_removal(removal: Removal, verb: str) -> None:
    for key in removal.entries:
        print(f"{verb} {key}")
    for key in removal.kept_young:
        print(f"kept {key} (written to within the grace period)")
    print(
        f"{verb} {count(len(removal.entries), 'entry', 'entries')}, "
        f"{count(removal.objects, 'object')}, {human(removal.bytes)}"
    )


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
    committed: Sequence[int], specs: Sequence[StepSpec], keep_latest: int | None, shown: str
) -> list[int]:
    """The committed steps ``rm`` removes: those ``specs`` name (a single step that is not
    committed is `CheckpointNotFoundError`, before anything is removed) and, with
    ``keep_latest``, all but the ``keep_latest`` latest."""
    present = set(committed)
    missing = sorted({s.first for s in specs if s.single and s.first not in present})
    if missing:
        some = f"step {missing[0]} is" if len(missing) == 1 else f"steps {_steps_text(missing)} are"
        raise CheckpointNotFoundError(f"{some} not committed in {shown}; nothing was removed")
    chosen = {s for s in committed for spec in specs if spec.first <= s <= spec.last}
    if keep_latest is not None:
        chosen |= set(sorted(committed)[: max(0, len(committed) - keep_latest)])
    return sorted(chosen)


def _steps_text(steps: Sequence[int]) -> str:
    """``1-3, 7``: ascending steps, runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


async def _committed(target: Backend | Tiered) -> list[int]:
    """Committed ckptstore steps (on tiers: on either tier); never an Orbax root's."""
    if isinstance(target, Tiered):
        async with target.opened() as (fast, durable):
            return await tier_steps(fast, durable)
    return await committed_steps(target)


async def _would_delete(target: Backend | Tiered, step: int) -> Removal:
    """What `delete_step` would remove (a dry run), from the same scan it makes."""

    async def on(backend: Backend) -> Removal | None:
        scanned = await scan_step(backend, step)
        if not scanned.committed:
            return None
        removal = Removal(entries=[layout.commit_key(step)], objects=1)
        for entry in scanned.entries if scanned.marker is not None else []:
            if entry.committed:  # an attempt another step references would stay (none yet)
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
    as_json: bool,
) -> int:
    """Remove the selected committed steps, oldest first; stops at the first failure (what
    was removed until then is still reported, then the error)."""
    committed = await _committed(target)
    steps = select_steps(committed, specs, keep_latest, shown)
    done: list[tuple[int, Removal]] = []
    failure: CkptStoreError | None = None
    for step in steps:
        try:
            removal = await (_would_delete if dry_run else delete_step)(target, step)
        except CkptStoreError as exc:
            failure = exc
            break
        done.append((step, removal))
    remaining = [s for s in committed if s not in {s for s, _ in done}]
    if as_json:
        doc: dict[str, Any] = {
            "dry_run": dry_run,
            "steps": [
                {"step": s, "entries": r.entries, "objects": r.objects, "bytes": r.bytes}
                for s, r in done
            ],
            "remaining": remaining,
        }
        if failure is not None:
            doc["error"] = str(failure)
        print(json.dumps(doc, indent=1))
    else:
        verb = "would remove" if dry_run else "removed"
        for _, removal in done:
            for key in removal.entries:
                print(f"{verb} {key}")
        if done:
            removals = [r for _, r in done]
            print(
                f"{verb} {count(len(done), 'step')} ({_steps_text([s for s, _ in done])}): "
                f"{count(sum(len(r.entries) for r in removals), 'entry', 'entries')}, "
                f"{count(sum(r.objects for r in removals), 'object')}, "
                f"{human(sum(r.bytes for r in removals))}"
            )
        elif failure is None:
            print(f"nothing to remove in {shown}")
        stay = "would remain" if dry_run else "remains" if len(remaining) == 1 else "remain"
        listed = f": {_steps_text(remaining)}" if remaining else ""
        print(f"{count(len(remaining), 'committed step')} {stay}{listed}")
    if failure is not None:
        raise failure
    return 0


async def cmd_gc(target: Backend | Tiered, older_than: float, dry_run: bool) -> int:
    removal = await gc(target, older_than=older_than, dry_run=dry_run)
    _print_removal(removal, "would remove" if dry_run else "removed")
    return 0


def parse_duration(flag: str) -> Callable[[str], float]:
    """An argparse type for ``flag``: ``90``, ``90s``, ``30m``, ``6h`` or ``2d`` as seconds."""

    def parse(text: str) -> float:
        try:
            return seconds(text, what=flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


async def cmd_import(args: argparse.Namespace, dst: Backend) -> int:
    result = await import_safetensors(
        args.src,
        dst,
        step=args.step,
        rules=args.map,
        batch_bytes=args.batch_mib << 20,
        progress=not args.no_progress,
    )
    print(
        f"imported {count(result.tensors, 'tensor')} ({human(result.bytes)}) in "
        f"{count(result.parts, 'part')} as step {result.save.step}; skipped {result.skipped}"
    )
    return 0


def _package_version() -> str:
    try:
        return version("ckptstore")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    # The global options are accepted before or after the command; SUPPRESS keeps a
    # subcommand's unset copy from overwriting one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--profile",
        default=argparse.SUPPRESS,
        help=f"a .toml profile, or a profile's name (default: ${PROFILE_ENV})",
    )
    common.add_argument(
        "--endpoint",
        default=argparse.SUPPRESS,
        help="the S3 or GCS endpoint URL (overrides the profile's and $AWS_ENDPOINT_URL)",
    )
    parser = argparse.ArgumentParser(
        prog="ckptstore",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"ckptstore {_package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, parents=[common])

    target_help = "a path, URL or .toml profile (default: the profile's URL)"
    ls = command("ls", "list committed steps")
    ls.add_argument("target", nargs="?", help=target_help)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("--all", action="store_true", help="uncommitted attempts too, with age")
    info = command("info", "describe one step's tree (latest by default)")
    info.add_argument("target", nargs="?", help=target_help)
    info.add_argument("--step", type=int)
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    verify = command("verify", "read every chunk and check its checksum")
    verify.add_argument("target", nargs="?", help=target_help)
    verify.add_argument("--step", type=int)
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    rm = command("rm", "delete committed steps (each one's marker first)")
    rm.add_argument("target", nargs="?", help=target_help)
    which = rm.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--step",
        dest="steps",
        action="append",
        type=parse_step_spec,
        metavar="N|A-B",
        help="a committed step, or every committed step from A to B (inclusive); repeatable",
    )
    which.add_argument(
        "--keep-latest",
        type=positive_int,
        metavar="N",
        help="every committed step but the N latest",
    )
    rm.add_argument("--dry-run", action="store_true", help="show what would go, remove nothing")
    rm.add_argument("--json", action="store_true", help="machine-readable output")
    collect = command("gc", "remove uncommitted attempts and unused parts")
    collect.add_argument("target", nargs="?", help=target_help)
    collect.add_argument(
        "--older-than",
        type=parse_duration("--older-than"),
        default=DEFAULT_GRACE,
        help="only what nobody wrote to for this long (default 6h; 0 = regardless of age)",
    )
    collect.add_argument("--dry-run", action="store_true", help="show, remove nothing")
    prom = command("promote", "copy committed steps from the fast to the durable tier")
    prom.add_argument("tiers", help="a .toml profile with a [tiers] table (fast, durable)")
    prom.add_argument("--step", type=int, help="only this step (default: every unpromoted one)")
    prom.add_argument("--no-progress", action="store_true")
    prom.add_argument(
        "--watch",
        action="store_true",
        help="keep promoting each step as it is committed, until SIGINT or SIGTERM",
    )
    prom.add_argument(
        "--interval",
        type=parse_duration("--interval"),
        default=5.0,
        help="with --watch: how often to look for new steps (default 5s)",
    )
    imp = command("import-safetensors", "stream a safetensors model into a checkpoint")
    imp.add_argument("src", help="a .safetensors file, a model folder, or its index.json")
    imp.add_argument("dst", help="checkpoint target (path, URL or .toml profile)")
    imp.add_argument("--step", type=int, default=0)
    imp.add_argument("--map", help="TOML rule file: renames, transposes, dtype casts")
    imp.add_argument(
        "--batch-mib",
        type=int,
        default=DEFAULT_BATCH_BYTES >> 20,
        help="tensor MiB per part (an import holds about twice this at a time)",
    )
    imp.add_argument("--no-progress", action="store_true")
    cli_orbax.add_parsers(sub)
    return parser


def _tiers_profile(args: argparse.Namespace) -> str | None:
    """The profile a command was given, when it describes tiers rather than one backend."""
    target: str | None = args.target
    profile: str | None = getattr(args, "profile", None)
    if target is None:
        profile = profile or os.environ.get(PROFILE_ENV) or None
    elif target.endswith(".toml") and profile is None:
        profile = target
    else:
        return None
    if profile is None:
        return None
    path = resolve_profile(profile)
    if not path.is_file() or "tiers" not in load_profile(path):
        return None
    if getattr(args, "endpoint", None):
        raise ConfigError(f"--endpoint does not apply to the tiers of {path}")
    return str(path)


async def _on_target(
    args: argparse.Namespace,
    target: str | None,
    run: Callable[[Backend, str], Awaitable[int]],
    *,
    must_exist: bool = True,
) -> int:
    """Open the target (with --profile and --endpoint), check it exists, run, close it."""
    options = {"endpoint": args.endpoint} if getattr(args, "endpoint", None) else {}
    backend = open_target(target, profile=getattr(args, "profile", None), **options)
    shown = target or backend.url
    try:
        if must_exist:
            try:
                await backend.check_root()
            except NotFoundError as exc:
                hint = ""
                if isinstance(backend, LocalBackend) and target and ":/" in target:
                    hint = " (a URL is written scheme://bucket/prefix)"
                raise NotFoundError(f"{exc.message}{hint}") from None
        return await run(backend, shown)
    finally:
        await backend.close()


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "promote":
        return asyncio.run(
            cmd_promote(
                args.tiers,
                args.step,
                not args.no_progress,
                watch=args.watch,
                interval=args.interval,
            )
        )
    if args.command in cli_orbax.COMMANDS:
        return asyncio.run(cli_orbax.run(args))
    if args.command == "import-safetensors":
        return asyncio.run(
            _on_target(args, args.dst, lambda b, _: cmd_import(args, b), must_exist=False)
        )
    if args.command == "ls" and (tiers := _tiers_profile(args)) is not None:
        if args.all:
            raise ConfigError(f"ls --all lists one store: give a tier of {tiers} (its URL)")
        return asyncio.run(cmd_ls_tiers(tiers, args.json))
    rm_args = (
        getattr(args, "steps", None) or [],
        getattr(args, "keep_latest", None),
        getattr(args, "dry_run", False),
        getattr(args, "json", False),
    )
    on_tiers: dict[str, Callable[[Tiered], Coroutine[Any, Any, int]]] = {
        "info": lambda t: cmd_info(t, args.step, args.json),
        "verify": lambda t: cmd_verify(t, args.step, args.json),
        "rm": lambda t: cmd_rm(t, args.target or "the tiers' profile", *rm_args),
        "gc": lambda t: cmd_gc(t, args.older_than, args.dry_run),
    }
    if args.command in on_tiers and (tiers := _tiers_profile(args)) is not None:
        return asyncio.run(on_tiers[args.command](Tiered.from_profile(tiers)))
    commands: dict[str, Callable[[Backend, str], Awaitable[int]]] = {
        "ls": lambda b, shown: (cmd_ls_all if args.all else cmd_ls)(b, shown, args.json),
        "info": lambda b, _: cmd_info(b, args.step, args.json),
        "verify": lambda b, _: cmd_verify(b, args.step, args.json),
        "rm": lambda b, shown: cmd_rm(b, shown, *rm_args),
        "gc": lambda b, _: cmd_gc(b, args.older_than, args.dry_run),
    }
    return asyncio.run(_on_target(args, args.target, commands[args.command]))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see ``ckptstore --help``)."""
    args = build_parser().parse_args(argv)
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows up here at the latest, not at exit
        return status
    except CkptStoreError as exc:
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE if storage_failed(exc) else EXIT_ERROR
    except BrokenPipeError:
        # The reader went away (`ckptstore info X | head`): stop quietly, as a command
        # killed by SIGPIPE would; the interpreter's final flush goes to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT
