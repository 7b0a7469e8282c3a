"""The package's layers: one folder per concern, and each imports only the layers below it
(docs/architecture.md, "Layers"). Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import ckptstore

PACKAGE = Path(ckptstore.__file__).parent

#: Top to bottom. `testing` (the shipped test helpers) stands beside them and may use any.
LAYERS = [
    "cli",
    "lifecycle",
    "importers",
    "orbax",
    "tiers",
    "checkpoint",
    "datapath",
    "format",
    "backends",
    "runtime",
    "errors",
]


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


#: Upward imports the reorganisation (issue 29) has still to carve out: tier and Orbax
#: branches of the checkpoint layer, moving to `ckptstore.api` and `ckptstore.tiers`.
PENDING = {
    "checkpoint/blocking imports ckptstore.tiers.read",
    "checkpoint/cleanup imports ckptstore.tiers.hostlocal",
    "checkpoint/cleanup imports ckptstore.tiers.target",
    "checkpoint/partial imports ckptstore.tiers.hostlocal",
    "checkpoint/partial imports ckptstore.tiers.target",
    "checkpoint/restore imports ckptstore.orbax",
    "checkpoint/save imports ckptstore.tiers.hostlocal",
    "checkpoint/save imports ckptstore.tiers.room",
    "checkpoint/save imports ckptstore.tiers.target",
    "orbax/exporter imports ckptstore.tiers.read",
    "orbax/exporter imports ckptstore.tiers.target",
}


def test_layers_import_downward_only() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] not in rank:
            continue  # the package's __init__ (the public API) and testing/
        for name in imported(ast.parse(path.read_text())):
            target = name.split(".")
            if target[0] == "ckptstore" and len(target) > 1 and target[1] in rank:
                if rank[target[1]] < rank[parts[0]]:
                    upward.append(f"{'/'.join(parts)} imports {name}")
    assert set(upward) <= PENDING, sorted(set(upward) - PENDING)
