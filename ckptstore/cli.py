"""The ``ckptstore`` command: what is in a checkpoint, and is it intact.

    ckptstore ls TARGET                  committed steps with sizes and times
    ckptstore info TARGET [--step N]     the tree: leaves, shapes, dtypes, bytes, shardings
    ckptstore verify TARGET [--step N]   read every chunk, checking its checksum
    ckptstore import-safetensors SRC DST [--step N] [--map RULES]
                                         stream a safetensors model into a checkpoint

TARGET is a path, a URL (s3://, gs://, file://) or a ``.toml`` profile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ckptstore.arrays import ocdbt_spec, open_leaf, read_slice
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.checkpoint.restore import committed_steps, load_manifest, read_manifest
from ckptstore.checkpoint.target import opened
from ckptstore.errors import CkptStoreError
from ckptstore.importers.safetensors import import_safetensors


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


async def cmd_ls(target: str, as_json: bool) -> int:
    async with opened(target) as backend:
        steps = await committed_steps(backend)
        manifests = await asyncio.gather(*(load_manifest(backend, s) for s in steps))
    rows: list[dict[str, Any]] = [
        {
            "step": m.step,
            "bytes": m.nbytes,
            "created": m.created,
            "items": sorted(m.items),
            "leaves": sum(len(i.leaves) for i in m.items.values()),
        }
        for m in manifests
    ]
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no committed checkpoints in {target}")
        return 0
    print(f"{'STEP':>10}  {'SIZE':>10}  {'LEAVES':>6}  {'CREATED':19}  ITEMS")
    for r in rows:
        print(
            f"{r['step']:>10}  {human(r['bytes']):>10}  {r['leaves']:>6}  "
            f"{when(r['created'])}  {','.join(r['items'])}"
        )
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
        manifest = await read_manifest(backend, step)
    if as_json:
        print(manifest.to_bytes().decode())
    else:
        _print_info(manifest)
    return 0


async def cmd_verify(target: str, step: int | None) -> int:
    """Read every leaf of a step; zarr3's crc32c codec checks every chunk on the way."""
    bad = 0
    async with opened(target) as backend:
        manifest = await read_manifest(backend, step)
        for item_name, item in manifest.items.items():
            store = ocdbt_spec(backend.kvstore_spec(layout.item_dir(manifest.step, item_name)))
            for leaf in item.leaves.values():
                try:
                    arr = await open_leaf(store, backend.ts_context, leaf)
                    await read_slice(arr, (), leaf.name)
                except CkptStoreError as exc:
                    bad += 1
                    print(f"CORRUPT {item_name}/{leaf.name}: {exc}")
    total = sum(len(i.leaves) for i in manifest.items.values())
    print(f"step {manifest.step}: {total - bad} of {total} leaves intact")
    return 1 if bad else 0


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
    info = sub.add_parser("info", help="describe one step's tree (latest by default)")
    info.add_argument("target")
    info.add_argument("--step", type=int)
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    verify = sub.add_parser("verify", help="read every chunk and check its checksum")
    verify.add_argument("target")
    verify.add_argument("--step", type=int)
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
            return asyncio.run(cmd_ls(args.target, args.json))
        if args.command == "info":
            return asyncio.run(cmd_info(args.target, args.step, args.json))
        if args.command == "import-safetensors":
            return asyncio.run(cmd_import(args))
        return asyncio.run(cmd_verify(args.target, args.step))
    except CkptStoreError as exc:
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
