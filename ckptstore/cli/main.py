"""The ``ckptstore`` command: what is in a checkpoint, and is it intact (``ckptstore --help``):
the parser, ``main`` (dispatch, errors as text or JSON, exit statuses) and
``import-safetensors``. The commands live one group per module: `steps` (ls, info, verify),
`remove` (rm, gc), `tiers` (promote, ls of tiers), `orbax` (import-orbax, export-orbax);
`output` says how every command answers (``--json``, progress, exit statuses)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.registry import PROFILE_ENV, load_profile, resolve_profile, target_profile
from ckptstore.checkpoint.cleanup import DEFAULT_GRACE
from ckptstore.checkpoint.target import open_target
from ckptstore.cli import orbax as cli_orbax
from ckptstore.cli.output import (
    EXIT_STATUSES,
    PROGRESS_AFTER,
    JsonArgumentParser,
    Output,
    error_json,
    exit_status,
    print_json,
)
from ckptstore.cli.remove import cmd_gc, cmd_rm, parse_step_spec, positive_int
from ckptstore.cli.steps import cmd_info, cmd_ls, cmd_ls_all, cmd_verify, cmd_verify_all
from ckptstore.cli.storing import add_storing_options, storing_options
from ckptstore.cli.text import count, human
from ckptstore.cli.tiers import cmd_ls_all_tiers, cmd_ls_tiers, cmd_promote
from ckptstore.errors import CkptStoreError, ConfigError, NotFoundError
from ckptstore.importers.safetensors import DEFAULT_BATCH_BYTES, import_safetensors
from ckptstore.lifecycle.options import seconds
from ckptstore.tiers.target import Tiered

DESCRIPTION = "What is in a checkpoint, and is it intact; cleanup, promotion and import."

SIGPIPE_EXIT = 128 + getattr(signal, "SIGPIPE", 13)


def _statuses_text() -> str:
    lines = []
    for code, text in EXIT_STATUSES.items():
        first, *more = textwrap.wrap(text, 76)
        lines += [f"  {code}  {first}", *(f"     {line}" for line in more)]
    lines.append(f"  128+N  stopped by signal N (a one-off promote); {SIGPIPE_EXIT}: a closed pipe")
    return "\n".join(lines)


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
  ckptstore verify /data/ckpt --all --json     every committed step, and a summary
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

output:
  Every command takes --json: one JSON document on stdout, an error too
  ({{"error": {{"type": ..., "message": ..., "exit": ...}}}}); promote --watch --json
  prints one document per line as it goes. Without --json, work that runs over
  {PROGRESS_AFTER:g} s draws a progress line (bytes, rate, time left) on stderr when
  stderr is a terminal; --progress draws it always, --no-progress never.

exit status:
{_statuses_text()}"""


def parse_duration(flag: str) -> Callable[[str], float]:
    """An argparse type for ``flag``: ``90``, ``90s``, ``30m``, ``6h`` or ``2d`` as seconds."""

    def parse(text: str) -> float:
        try:
            return seconds(text, what=flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


async def cmd_import(args: argparse.Namespace, dst: Backend) -> int:
    out = Output.from_args(args)
    result = await import_safetensors(
        args.src,
        dst,
        step=args.step,
        rules=args.map,
        batch_bytes=args.batch_mib << 20,
        progress=out.bar("tensors", 0),
        **args.storing,
    )
    if out.json:
        print_json(
            {
                "step": result.save.step,
                "attempt": result.save.attempt,
                "tensors": result.tensors,
                "skipped": result.skipped,
                "bytes": result.bytes,
                "parts": result.parts,
            }
        )
        return 0
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


def _common_options() -> JsonArgumentParser:
    """The options every command takes, before or after the command's name. SUPPRESS keeps
    a subcommand's unset copy from overwriting one given before it."""
    common = JsonArgumentParser(add_help=False)
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
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="one JSON document on stdout (errors too); no progress line",
    )
    common.add_argument(
        "--progress",
        action="store_true",
        default=argparse.SUPPRESS,
        help="draw the progress line even when stderr is not a terminal, from the start",
    )
    common.add_argument(
        "--no-progress",
        action="store_true",
        default=argparse.SUPPRESS,
        help="never draw the progress line",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = JsonArgumentParser(
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
    ls.add_argument("--all", action="store_true", help="uncommitted attempts too, with age")
    info = command("info", "describe one step's tree (latest by default)")
    info.add_argument("target", nargs="?", help=target_help)
    info.add_argument("--step", type=int)
    verify = command("verify", "read every chunk and check its checksum")
    verify.add_argument("target", nargs="?", help=target_help)
    one_or_all = verify.add_mutually_exclusive_group()
    one_or_all.add_argument("--step", type=int, help="this step (default: the latest)")
    one_or_all.add_argument(
        "--all",
        action="store_true",
        help="every committed step, and a summary (status 1 if any is corrupt)",
    )
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
    prom.add_argument(
        "tiers", metavar="PROFILE", help="a .toml profile with a [tiers] table (fast, durable)"
    )
    prom.add_argument("--step", type=int, help="only this step (default: every unpromoted one)")
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
    add_storing_options(imp)
    cli_orbax.add_parsers(sub, common)
    return parser


def _tiers_profile(args: argparse.Namespace) -> str | None:
    """The profile a command was given, when it describes tiers rather than one backend."""
    target: str | None = args.target
    profile: str | None = getattr(args, "profile", None)
    if target is None:
        profile = profile or os.environ.get(PROFILE_ENV) or None
    elif profile is None and (named := target_profile(target)) is not None:
        profile = str(named)
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
    out = Output.from_args(args)
    if args.command in ("import-safetensors", "import-orbax"):
        args.storing = storing_options(args)  # checked before any target is opened
    if args.command == "promote":
        return asyncio.run(
            cmd_promote(args.tiers, args.step, out, watch=args.watch, interval=args.interval)
        )
    if args.command in cli_orbax.COMMANDS:
        return asyncio.run(cli_orbax.run(args))
    if args.command == "import-safetensors":
        return asyncio.run(
            _on_target(args, args.dst, lambda b, _: cmd_import(args, b), must_exist=False)
        )
    if args.command == "ls" and (tiers := _tiers_profile(args)) is not None:
        ls = cmd_ls_all_tiers if args.all else cmd_ls_tiers
        return asyncio.run(ls(tiers, out.json))
    rm_args = (
        getattr(args, "steps", None) or [],
        getattr(args, "keep_latest", None),
        getattr(args, "dry_run", False),
        out,
    )

    def verify(target: Backend | Tiered, shown: str) -> Coroutine[Any, Any, int]:
        if args.all:
            return cmd_verify_all(target, shown, out)
        return cmd_verify(target, args.step, out)

    on_tiers: dict[str, Callable[[Tiered], Coroutine[Any, Any, int]]] = {
        "info": lambda t: cmd_info(t, args.step, out.json),
        "verify": lambda t: verify(t, args.target or "the tiers' profile"),
        "rm": lambda t: cmd_rm(t, args.target or "the tiers' profile", *rm_args),
        "gc": lambda t: cmd_gc(t, args.older_than, args.dry_run, out.json),
    }
    if args.command in on_tiers and (tiers := _tiers_profile(args)) is not None:
        return asyncio.run(on_tiers[args.command](Tiered.from_profile(tiers)))
    commands: dict[str, Callable[[Backend, str], Awaitable[int]]] = {
        "ls": lambda b, shown: (cmd_ls_all if args.all else cmd_ls)(b, shown, out.json),
        "info": lambda b, _: cmd_info(b, args.step, out.json),
        "verify": verify,
        "rm": lambda b, shown: cmd_rm(b, shown, *rm_args),
        "gc": lambda b, _: cmd_gc(b, args.older_than, args.dry_run, out.json),
    }
    return asyncio.run(_on_target(args, args.target, commands[args.command]))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see ``ckptstore --help``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    JsonArgumentParser.json_requested = "--json" in argv  # usage errors as JSON too
    args = build_parser().parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows up here at the latest, not at exit
        return status
    except CkptStoreError as exc:
        status = exit_status(exc)
        if as_json:
            print_json(error_json(type(exc).__name__, str(exc), status))
        else:
            print(f"ckptstore: error: {exc}", file=sys.stderr)
        return status
    except BrokenPipeError:
        # The reader went away (`ckptstore info X | head`): stop quietly, as a command
        # killed by SIGPIPE would; the interpreter's final flush goes to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT
