"""The package's layers: one folder per concern, and each imports only the layers below it,
never a peer on its own row (docs/architecture.md, "Layers"). Imports inside functions
count too."""

from __future__ import annotations

import ast
from pathlib import Path

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
    assert set(loose) == {"__init__.py", "api.py", "errors.py", "testing", *LAYERS} - {
        "api",
        "errors",
    }


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
