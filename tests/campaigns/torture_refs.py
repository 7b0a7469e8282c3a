"""The torture campaign's checks of what a store holds (tests/campaigns/torture.py): which
objects committed steps use, including the attempts incremental steps reference, and
whether every reference still finds its bytes.

An incremental step (``save(..., base=B)``) reads its unchanged leaves from another
attempt, its *holder* (docs/incremental.md): the attempt of B, or the one B itself
references. A holder whose own step was deleted has no marker, but its bytes must stay as
long as a committed step references it, and `gc` must free them once none does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from ckptstore.backends.base import Backend
from ckptstore.errors import CkptStoreError
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import Attempt, load_manifest, read_marker


async def everything(backend: Backend) -> set[str]:
    """Every stored key; a local root is walked on disk, so temporary files count too."""
    root = getattr(backend, "root", None)
    if backend.kind == "local" and isinstance(root, Path):
        return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    return {info.key async for info in backend.list()}


async def manifests(backend: Backend, steps: Iterable[int]) -> dict[int, Manifest]:
    """The committed manifests of ``steps`` (those with a readable marker)."""
    out: dict[int, Manifest] = {}
    for step in steps:
        marker = await read_marker(backend, step)
        if marker is not None and marker.attempt is not None:
            out[step] = await load_manifest(backend, marker)
    return out


async def committed_keys(backend: Backend, keys: set[str]) -> set[str]:
    """Those of ``keys`` that a committed step uses: its marker, its attempt, and the
    attempts its manifest references (held bytes of deleted bases among them)."""
    steps = {
        layout.parse_step(k.split("/")[0])
        for k in keys
        if k.count("/") == 1
        and (layout.parse_step_record(k.split("/")[1]) or ("",))[0] == layout.COMMIT_MARKER
    }
    markers = await asyncio.gather(*(read_marker(backend, s) for s in steps if s is not None))
    roots = [m.where.root + "/" for m in markers if m is not None]
    marks = {m.key for m in markers if m is not None}
    found = await manifests(backend, [m.step for m in markers if m is not None])
    for manifest in found.values():
        for ref in manifest.references:
            roots.append(ref.dir.root + "/")
    return {k for k in keys if k in marks or any(k.startswith(r) for r in roots)}


async def check_references(backend: Backend, steps: Iterable[int]) -> tuple[list[str], set[str]]:
    """Every reference of the committed ``steps`` finds its holder's bytes: the holder's
    manifest, a live fate (not abandoned or collected), a store below each item it is read
    from and the pack of each packed leaf read from it. Returns the problems, and the
    holders whose own step no longer names them (a deleted base's bytes, still held)."""
    problems: list[str] = []
    held: set[str] = set()
    for step, manifest in (await manifests(backend, steps)).items():
        for k, ref in enumerate(manifest.references):
            where = ref.dir
            keys = {info.key async for info in backend.list(where.root)}
            why: list[str] = []
            if where.manifest not in keys:
                why.append("its manifest is gone")
            try:
                fate = await Attempt(backend, where).fate()
            except CkptStoreError as exc:
                why.append(f"its fate is unreadable ({exc})")
            else:
                if fate is not None and fate.dead:
                    why.append(f"it is {fate.describe()}")
            for name, item in manifest.items.items():
                for leaf, index in item.refs.items():
                    if index != k:
                        continue
                    below = where.item(name) + "/"
                    pack = item.packed.get(leaf)
                    if pack is not None and below + pack.key not in keys:
                        why.append(f"the pack of {name}/{leaf} ({pack.key}) is gone")
                    elif pack is None and not any(x.startswith(below) for x in keys):
                        why.append(f"the store of {name}/{leaf} is gone")
            if why:
                problems.append(f"step {step} references {where.root}: {'; '.join(why)}")
            marker = await read_marker(backend, where.step)
            if marker is None or marker.attempt != where.attempt:
                held.add(where.root)
    return problems, held
