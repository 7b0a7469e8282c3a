"""The house's measures: how far a save and a restore walk through the package, and how its
code is shaped. Not a timing: the same counts on any machine, for the layout's before and
after (issue 62; docs/architecture.md).

- ``walks``: for a plain save and restore (one local directory) and a tiered one (two), the
  package's modules and functions each touches, and its calls back up a layer (a function
  calling one of a layer above it; `runtime` running what it was handed is not counted),
  traced on every thread as ``tests/test_layers.py`` traces them.
- ``protocol``: the modules outside the commit protocol's home that import it, and the
  distinct names they import from it.
- ``markers``: the functions that create a commit marker (each is a commit engine or a
  promotion of one).
- ``sizes``: the longest functions and modules, and how many pass 80 and 500 lines.
- ``duplicates``: the pairs the ``duplicates`` command finds in the package, if it is here.

    python benchmarks/house.py            # writes benchmarks/results/house.json
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ckptstore  # noqa: E402
from tests.test_layers import LAYERS, ROWS, _calls_between_layers  # noqa: E402

PACKAGE = Path(ckptstore.__file__).parent
RANK = {name: i for i, row in enumerate(ROWS) for name in row}


def _walk(work: Any) -> dict[str, Any]:
    """What ``work()`` touches: modules, functions, and its calls back up a layer."""
    touched: set[tuple[str, str]] = set()

    def record(frame: Any, event: str, arg: object) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and PACKAGE in path.parents:
            touched.add((str(path.relative_to(PACKAGE)), frame.f_code.co_qualname))

    edges = _calls_between_layers(lambda: _profiled(record, work))
    upward = sorted(
        f"{a}:{fa} -> {b}:{fb}"
        for a, b, fa, fb in edges
        if a in LAYERS and b in LAYERS and RANK[b] < RANK[a] and a != "runtime"
    )
    return {
        "modules": len({m for m, _ in touched}),
        "functions": len(touched),
        "calls_up": len(upward),
        "calls_up_list": upward,
    }


def _profiled(record: Any, work: Any) -> None:
    """``work()`` with ``record`` chained after the layer tracer already installed."""
    import threading

    outer = sys.getprofile()

    def both(frame: Any, event: str, arg: object) -> None:
        record(frame, event, arg)
        if outer is not None:
            outer(frame, event, arg)

    threading.setprofile(both)
    sys.setprofile(both)
    try:
        work()
    finally:
        sys.setprofile(outer)
        threading.setprofile(outer)


def walks() -> dict[str, Any]:
    state = {"w": np.arange(1 << 16, dtype=np.float32), "b": {"x": np.ones(10)}}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = str(Path(tmp) / "plain")
        tiered = ckptstore.Tiered(fast=str(Path(tmp) / "fast"), durable=str(Path(tmp) / "dur"))
        for name, target in (("plain", plain), ("tiered", tiered)):
            asyncio.run(ckptstore.save(target, state, step=0))  # imports, caches
            out[f"{name} save"] = _walk(
                lambda t=target: asyncio.run(ckptstore.save(t, state, step=1))
            )
            out[f"{name} restore"] = _walk(lambda t=target: asyncio.run(ckptstore.restore(t, 1)))
    return out


def _modules() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))
    }


def protocol(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """Who imports the commit protocol from outside its home (``protocol/`` once it is a
    folder; ``checkpoint/commit.py`` before)."""
    home = "protocol/" if (PACKAGE / "protocol").is_dir() else "checkpoint/commit.py"
    dotted = "ckptstore." + home.rstrip("/").removesuffix(".py").replace("/", ".")
    callers: dict[str, set[str]] = {}
    for module, tree in trees.items():
        if module.startswith(home):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(dotted):
                callers.setdefault(module, set()).update(a.name for a in node.names)
    return {
        "home": home,
        "modules": len(callers),
        "names": len(set().union(*callers.values())) if callers else 0,
        "by_module": {m: sorted(n) for m, n in sorted(callers.items())},
    }


def markers(trees: dict[str, ast.Module]) -> list[str]:
    """Functions that call ``create_marker`` (the marker is created in one place each)."""
    found = []
    for module, tree in trees.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call):
                        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                        if name == "create_marker":
                            found.append(f"{module}:{fn.name}")
                            break
    return sorted(set(found))


def sizes(trees: dict[str, ast.Module]) -> dict[str, Any]:
    functions = []
    for module, tree in trees.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert fn.end_lineno is not None
                functions.append((fn.end_lineno - fn.lineno + 1, f"{module}:{fn.name}"))
    modules = [(len((PACKAGE / m).read_text().splitlines()), m) for m in trees]
    functions.sort(reverse=True)
    modules.sort(reverse=True)
    return {
        "modules": len(modules),
        "functions_over_80": sum(n > 80 for n, _ in functions),
        "modules_over_500": sum(n > 500 for n, _ in modules),
        "longest_functions": [f"{w} ({n})" for n, w in functions[:5]],
        "longest_modules": [f"{w} ({n})" for n, w in modules[:5]],
    }


def duplicates() -> str | None:
    if shutil.which("duplicates") is None:
        return None
    done = subprocess.run(
        ["duplicates", "--seconds", "120"], cwd=PACKAGE, capture_output=True, text=True
    )
    return done.stdout.splitlines()[0] if done.stdout else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "house.json"))
    args = parser.parse_args()
    trees = _modules()
    result = {
        "walks": walks(),
        "protocol": protocol(trees),
        "markers": markers(trees),
        "sizes": sizes(trees),
        "duplicates": duplicates(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, walk in result["walks"].items():
        print(
            f"{name:16} modules {walk['modules']:3}  functions {walk['functions']:4}  "
            f"calls up {walk['calls_up']}"
        )
    proto = result["protocol"]
    print(f"protocol ({proto['home']}): {proto['modules']} modules import {proto['names']} names")
    print(f"marker created in: {', '.join(result['markers'])}")
    print(json.dumps(result["sizes"], indent=1))
    print(result["duplicates"])


if __name__ == "__main__":
    main()
