"""The package's layers: one folder per concern, and each imports only the layers below it,
never a peer on its own row (docs/architecture.md, "Layers"). Imports inside functions
count too."""

from __future__ import annotations

import ast
import asyncio
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

import ckptstore

PACKAGE = Path(ckptstore.__file__).parent

#: Top to bottom; the features on one row know nothing of each other (`api` composes them).
#: `testing` (the shipped test helpers) stands beside them and may use any.
ROWS = [
    ["cli"],
    ["lifecycle"],
    ["api"],
    ["importers", "orbax", "tiers"],
    ["checkpoint"],
    ["protocol"],
    ["datapath"],
    ["format"],
    ["backends"],
    ["runtime"],
    ["errors"],
]
LAYERS = [name for row in ROWS for name in row]


def imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ckptstore":  # `from ckptstore import x`: x may be a module
                names += [f"ckptstore.{alias.name}" for alias in node.names]
            else:
                names.append(node.module)
    return names


def test_every_module_is_in_a_layer() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py")) + sorted(
        p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    )
    assert set(loose) == {"__init__.py", "errors.py", "testing", *LAYERS} - {"errors"}


def test_layers_import_downward_only() -> None:
    rank = {name: i for i, row in enumerate(ROWS) for name in row}
    upward = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] not in rank:
            continue  # the package's __init__ (the public API) and testing/
        for name in imported(ast.parse(path.read_text())):
            target = name.split(".")
            if target[0] == "ckptstore" and len(target) > 1 and target[1] in rank:
                if target[1] != parts[0] and rank[target[1]] <= rank[parts[0]]:
                    upward.append(f"{'/'.join(parts)} imports {name}")
    assert not upward, sorted(set(upward))


def _layer_of(code: object) -> str | None:
    """The layer a function's code belongs to (None: outside the package, or its
    ``__init__``)."""
    path = Path(getattr(code, "co_filename", ""))
    if PACKAGE not in path.parents:
        return None
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0] if parts[0] in LAYERS else None


def _calls_between_layers(work: Any) -> set[tuple[str, str, str, str]]:
    """Every distinct (caller layer, callee layer, caller, callee) call ``work()`` makes
    from one layer's function into another's, on any thread it starts."""
    edges: set[tuple[str, str, str, str]] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or (callee := _layer_of(frame.f_code)) is None:
            return
        back = frame.f_back
        while back is not None and _layer_of(back.f_code) is None:
            back = back.f_back
        caller = None if back is None else _layer_of(back.f_code)
        if caller is not None and caller != callee:
            assert back is not None
            edges.add((caller, callee, back.f_code.co_qualname, frame.f_code.co_qualname))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return edges


def test_a_save_and_a_restore_call_up_a_layer_only_through_runtime(tmp_path: Path) -> None:
    """The walk of docs/architecture.md ("One save, one restore, through the folders")
    goes down the layers: a function calls one of a layer above it only where `runtime`
    runs what it was handed (a thread, a hand-off round, a gather). A restore once called
    back up into a closure of `api`, and a pack write from `format/` into `backends/`."""
    state = {"w": np.arange(1 << 16, dtype=np.float32), "b": {"x": np.ones(10)}}
    asyncio.run(ckptstore.save(str(tmp_path), state, step=0))  # imports, pools, caches
    rank = {name: i for i, row in enumerate(ROWS) for name in row}
    edges = _calls_between_layers(
        lambda: asyncio.run(ckptstore.save(str(tmp_path), state, step=1))
    ) | _calls_between_layers(lambda: asyncio.run(ckptstore.restore(str(tmp_path), 1)))
    upward = sorted(e for e in edges if rank[e[1]] < rank[e[0]] and e[0] != "runtime")
    assert not upward, upward
    assert any(e[0] == "api" for e in edges) and any(e[1] == "datapath" for e in edges)


#: The calls a save makes back up into `tiers` (the storage it saves to), by name: the
#: phases of `checkpoint.save.SaveHooks`, which `tiers.save.TierHooks` fills in.
HOOKS = {
    "TierHooks.before_attempt",
    "TierHooks.before_write",
    "TierHooks.after_write",
    "TierHooks.finish",
    "TierHooks.after_finish",
}


def test_a_tiered_save_and_restore_call_up_only_through_the_named_hooks(tmp_path: Path) -> None:
    """A save on tiers runs in `checkpoint` with the tiers' hooks: its only calls back up
    a layer are those hooks, named in `SaveHooks`; a tiered restore calls up nowhere."""
    state = {"w": np.arange(1 << 16, dtype=np.float32), "b": {"x": np.ones(10)}}
    tiered = ckptstore.Tiered(fast=str(tmp_path / "fast"), durable=str(tmp_path / "durable"))
    asyncio.run(ckptstore.save(tiered, state, step=0))  # imports, pools, caches
    rank = {name: i for i, row in enumerate(ROWS) for name in row}
    edges = _calls_between_layers(
        lambda: asyncio.run(ckptstore.save(tiered, state, step=1))
    ) | _calls_between_layers(lambda: asyncio.run(ckptstore.restore(tiered, 1)))
    upward = {e for e in edges if rank[e[1]] < rank[e[0]] and e[0] != "runtime"}
    assert {e[3] for e in upward} <= HOOKS, sorted(upward)
    assert {e[3] for e in upward} == HOOKS  # every phase's hook was called: the trace saw them
    assert all(e[:2] == ("checkpoint", "tiers") for e in upward), sorted(upward)
