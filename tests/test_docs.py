"""The examples in the docs stay true."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.importers.safetensors import load_rules
from tests.helpers import DOCS, run_block


def blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (DOCS / doc).read_text(), re.S)


def test_rule_file_example_parses_and_maps(tmp_path: Path) -> None:
    (rules_toml,) = blocks("partial-saves.md", "toml")
    file = tmp_path / "rules.toml"
    file.write_text(rules_toml)
    rules = load_rules(file)
    up = rules.apply("model.layers.3.mlp.up.weight")
    assert up is not None and up.path == ("layers", "3", "up", "kernel") and up.transpose is True
    norm = rules.apply("model.norm.scale")
    assert norm is not None and norm.path == ("final_norm", "scale") and norm.dtype is not None
    assert rules.apply("lm_head.weight") is None
    default = rules.apply("model.embed.weight")
    assert default is not None and default.path == ("model", "embed", "weight")


def test_plain_tensorstore_example_reads_a_leaf(tmp_path: Path) -> None:
    (example,) = [b for b in blocks("architecture.md", "python") if "ts.open" in b]
    w = np.arange(2 << 20, dtype=np.float32).reshape(2048, 1024)  # 8 MiB: not packed
    ckptstore.save_sync(str(tmp_path), {"params": {"dense": {"kernel": w}}}, step=100)
    code = example.replace("/ckpt/", f"{tmp_path}/")
    namespace: dict[str, object] = {}
    exec(compile(code.replace("print(", "result = ("), "example", "exec"), namespace)
    arr = namespace["arr"]
    assert isinstance(arr, ts.TensorStore)
    np.testing.assert_array_equal(arr.read().result(), w)


def test_manager_profile_example_is_valid(tmp_path: Path) -> None:
    (profile,) = blocks("manager.md", "toml")
    file = tmp_path / "run.toml"
    file.write_text(profile)
    loaded = ckptstore.load_profile(file)
    options = ckptstore.ManagerOptions.from_table(loaded["manager"])
    assert options.timeout == 600 and options.gc_grace == 600 and options.if_busy == "wait"
    assert isinstance(options.save_policy, ckptstore.policies.AnyOf)
    assert isinstance(options.keep_policy, ckptstore.policies.KeepAnyOf)


def test_readme_quick_start_runs_as_written_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its mkdtemp: below tmp_path
    readme = (DOCS.parent / "README.md").read_text()
    (code,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", readme, re.S)
    for _ in range(2):  # a second run works as the first did
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README quick start", "exec"), {"__name__": "readme"})
        assert printed.getvalue().splitlines() == ["[100]", "True", "[28, 29, 30]"]
    assert "# committed steps only: [100]" in code and "all_steps())  " in code
    assert code.rstrip().endswith("# [28, 29, 30]")  # as commented: the last saves committed
    made = sorted(p for p in tmp_path.iterdir() if not p.name.endswith("-run"))
    assert len(made) == 2
    for path in made:
        assert ckptstore.list_steps_sync(str(path)) == [100]
        assert ckptstore.list_steps_sync(f"{path}-run") == [28, 29, 30]


def test_orbax_in_example_runs_as_written(tmp_path: Path) -> None:
    (example,) = [b for b in blocks("interop.md", "python") if '"/tmp/orbax-run"' in b]
    code = example.replace('"/tmp/orbax-run"', repr(str(tmp_path / "orbax-run")))
    namespace: dict[str, object] = {}
    exec(compile(code, "interop.md Orbax in", "exec"), namespace)
    state = namespace["state"]
    assert isinstance(state, dict)
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.arange(32).reshape(8, 4))


def test_orbax_out_example_runs_as_written(tmp_path: Path) -> None:
    (example,) = [b for b in blocks("interop.md", "python") if "export_orbax" in b]
    code = example
    for name in ("/tmp/ckptstore-run", "/tmp/orbax-export-run", "/tmp/orbax-export"):
        code = code.replace(f'"{name}"', repr(str(tmp_path / name.rsplit("/", 1)[1])))
    assert '"/tmp/' not in code  # every path replaced
    namespace: dict[str, object] = {}
    exec(compile(code, "interop.md Orbax out", "exec"), namespace)
    state, again = namespace["state"], namespace["again"]
    assert isinstance(state, dict) and isinstance(again, dict)
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert np.asarray(state["params"]["w"]).tobytes() == w.tobytes()
    assert again["step"] == 10 and np.asarray(again["params"]["w"]).tobytes() == w.tobytes()


def test_migrating_from_orbax_examples_run_against_both_libraries(tmp_path: Path) -> None:
    examples = [  # "Move an existing run" has a test of its own
        b
        for b in blocks("migrating-from-orbax.md", "python")
        if b.startswith(("# Orbax\n", "# ckptstore\n"))
    ]
    pairs = list(zip(examples[::2], examples[1::2], strict=True))
    assert len(pairs) == 3
    for n, (orbax, ours) in enumerate(pairs):
        assert orbax.startswith("# Orbax\n") and "import orbax.checkpoint" in orbax
        assert ours.startswith("# ckptstore\n") and "orbax" not in ours
        got_orbax, said_orbax = run_block(orbax, tmp_path / f"{n}-orbax")
        got_ours, said_ours = run_block(ours, tmp_path / f"{n}-ckptstore")
        assert got_orbax == said_orbax, orbax
        assert got_ours == said_ours, ours
        if n == 1:  # best steps: Orbax deletes the latest step, ckptstore never does
            assert got_orbax[0] == "[10, 30]" and got_ours[0] == got_ours[2] == "[10, 30, 50]"
            assert got_orbax[1] == got_ours[1] == "30"
        else:  # the same answers, side by side
            assert got_ours == got_orbax


def test_migrating_from_orbax_table_names_real_api() -> None:
    """Every ckptstore name in the mapping table exists."""
    import orbax.checkpoint as ocp

    text = (DOCS / "migrating-from-orbax.md").read_text()
    for name in ("EveryNSteps", "InitialStep", "AnyOf", "KeepLatest", "KeepBest", "KeepAnyOf"):
        assert f"{name}(" in text and hasattr(ckptstore.policies, name)
    assert "KeepEveryNSteps(n)" in text and hasattr(ckptstore.policies, "KeepEveryNSteps")
    for option in ("save_interval_steps", "max_to_keep", "best_fn", "best_mode", "keep_period"):
        assert option in text and option in ocp.CheckpointManagerOptions.__dataclass_fields__
    manager = ckptstore.CheckpointManager
    for method in ("save", "restore", "wait_until_finished", "latest_step", "all_steps", "close"):
        assert hasattr(manager, method) and hasattr(ocp.CheckpointManager, method)
    assert hasattr(manager, "metrics") and hasattr(ckptstore, "read_manifest_sync")
    # Each row's `mngr.NAME`s exist on its side's manager, and a row maps each of these
    # Orbax methods (what an Orbax user reaches for) to the manager's own.
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| `")]
    for orbax, ours in ((r[0], r[1]) for r in rows):
        for name in re.findall(r"mngr\.(\w+)", orbax):
            assert hasattr(ocp.CheckpointManager, name), orbax
        for name in re.findall(r"mngr\.(\w+)", ours):
            assert hasattr(manager, name), ours
    mapped = {n for r in rows for n in re.findall(r"mngr\.(\w+)", r[0])}
    mapped &= {n for r in rows for n in re.findall(r"mngr\.(\w+)", r[1])}
    wanted = {"best_step", "should_save", "delete", "reload", "metadata", "item_metadata"}
    wanted |= {"directory", "is_saving_in_progress", "check_for_errors", "metrics"}
    assert wanted <= mapped, sorted(wanted - mapped)


# Every name of ours the docs give in backticks exists: `ckptstore.X`, a dotted name below
# the package as the docs write it (`checkpoint.save.prepare`, `runtime/hostpool.py`,
# `tiers/status.status`), a class of ours and its attributes (`Stager.warm`), and a path
# in the repository (`benchmarks/scale.py`, `tests/campaigns/test_torture.py::test_name`).
PACKAGE = Path(ckptstore.__file__).resolve().parent
REPO = DOCS.parent
TOP = {  # the first component a name of ours starts with
    p.stem
    for p in PACKAGE.iterdir()
    if (p / "__init__.py").exists() or (p.suffix == ".py" and not p.name.startswith("_"))
} | {"ckptstore"}
IN_REPO = ("benchmarks", "tests", "docs", "demo", "backends")  # folders at the root
FILES = (".py", ".md", ".toml", ".json", ".png", ".txt")
NOT_CODE = {"ckptstore.aws"}  # a logger's name (backends/sdklog.py)
NAME = re.compile(r"(?<![\w.\-/])([A-Za-z_]\w*(?:(?:\.|/|::)[\w*<>\-]*)+)")


def our_classes() -> dict[str, str]:
    """Each class name defined in exactly one module of the package -> that module."""
    import ast

    where: dict[str, list[str]] = {}
    for file in PACKAGE.rglob("*.py"):
        module = ".".join(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module.removesuffix(".__init__"))
    return {name: modules[0] for name, modules in where.items() if len(modules) == 1}


CLASSES = our_classes()


def names_in(text: str) -> list[str]:
    """The names of ours in ``text``: inline code spans; in fenced blocks, repository paths
    and, in Python ones, ``ckptstore.X`` and ``from ckptstore.x import a, b``."""
    found: list[str] = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        found += re.findall(r"(?<![\w.\-/])((?:benchmarks|tests|docs)/[\w/.\-*]+)", block)
        if lang == "python":
            found += re.findall(r"(?<![\w.])(ckptstore(?:\.\w+)+)", block)
            for module, imported in re.findall(r"from (ckptstore[\w.]*) import ([\w, ]+)", block):
                found += [f"{module}.{n.split(' as ')[0].strip()}" for n in imported.split(",")]
    inline = re.sub(r"```.*?```", "", text, flags=re.S)
    ours = TOP | set(IN_REPO) | set(CLASSES)
    for span in re.findall(r"`([^`]+)`", inline):
        found += [n for n in NAME.findall(span) if re.split(r"[./:]", n)[0] in ours]
    return [n.rstrip(".,:") for n in found if "<" not in n and n not in NOT_CODE]


def has(obj: object, attr: str) -> bool:
    """``obj.attr`` exists, a class's fields without a default included."""
    fields = {a for c in getattr(obj, "__mro__", ()) for a in getattr(c, "__annotations__", {})}
    return hasattr(obj, attr) or attr in fields


def exists(name: str) -> bool:
    """Whether ``name`` is a file of the repository or the package, or a module, class,
    function or attribute of the package."""
    import importlib

    name, _, test = name.partition("::")
    if name.endswith("/") or name.endswith(FILES):
        for base in (REPO, PACKAGE):
            found = list(base.glob(name)) if "*" in name else [base / name]
            if found and found[0].exists():
                return not test or f"def {test}(" in found[0].read_text()
        return False
    path, _, attrs = name.partition(".") if "/" in name else ("", "", name)
    parts = [*path.split("/"), *attrs.split(".")] if path else attrs.split(".")
    if parts[0] in IN_REPO and parts[0] not in TOP:  # a module run as `python -m tests.x`
        return (REPO.joinpath(*parts[:-1]) / f"{parts[-1]}.py").exists()
    if parts[0] in CLASSES and parts[0] not in TOP:  # `Class.attr`
        parts = [*CLASSES[parts[0]].split("."), *parts]
    parts = parts[1:] if parts[0] == "ckptstore" else parts
    for i in range(len(parts), -1, -1):
        module = ".".join(["ckptstore", *parts[:i]])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not f"{module}.".startswith(f"{e.name}."):
                raise  # a module that is there failed to import
            continue
        for attr in parts[i:]:
            if not has(obj, attr):
                return False
            obj = getattr(obj, attr, None)
        return True
    return False


def test_names_in_the_docs_exist() -> None:
    docs = [*sorted(DOCS.glob("*.md")), REPO / "README.md"]
    named = {(doc.name, n) for doc in docs for n in names_in(doc.read_text())}
    assert len(named) > 250  # the docs name a lot; none of it is missed silently
    broken = sorted(f"{doc}: `{n}`" for doc, n in named if not exists(n))
    assert not broken, "\n".join(broken)
    # ...and a name that is not there is found
    for made_up in ("ckptstore.no_such", "checkpoint.save.NoSuch", "tiers/nosuch.py"):
        assert not exists(made_up), made_up
    assert not exists("Stager.no_such") and not exists("benchmarks/no*.py")
    assert not exists("tests/test_docs.py::test_no_such")
    text = "`runtime/hostpool.release_deferred`, `SaveStats.base`, not `jax.device_get`"
    assert names_in(text) == ["runtime/hostpool.release_deferred", "SaveStats.base"]


def test_layers_name_every_module() -> None:
    """The tree in architecture.md's "Layers" names each folder's modules, and no other,
    and counts them right."""
    text = (DOCS / "architecture.md").read_text()
    (tree,) = re.findall(r"## Layers\n.*?```\n(.*?)```", text, re.S)
    counted: dict[str, int] = {}
    named: dict[str, set[str]] = {}
    folder = ""
    for line in tree.splitlines():
        counted |= {f: int(n) for f, n in re.findall(r"(?<![\w/.])(\w+)/ \[(\d+)\]", line)}
        head = re.match(r" {0,31}(\w+)/(?: \[\d+\])?|(\S+\.py) ", line)
        if head:  # a folder's row, or a module of the package's own
            folder, line = head[1] or "", line[head.end() :]
        named.setdefault(folder, set()).update(re.findall(r"(?<![\w/.])(\w+\.py)\b", line))
    assert set(counted) <= set(named) and len(named) > 10
    for folder, names in named.items():
        modules = {p.name for p in (PACKAGE / folder).glob("*.py")}
        assert names <= modules, (folder, names - modules)
        if folder:
            assert modules - names <= {"__init__.py", "__main__.py"}, (folder, modules - names)
        mine = {m for m in modules if m != "__init__.py"}
        assert counted.get(folder, len(mine)) == len(mine), (folder, counted[folder], mine)


def test_codecs_example_runs_and_its_profile_is_valid(tmp_path: Path) -> None:
    (example,) = blocks("codecs.md", "python")
    got, said = run_block(example, tmp_path)
    assert got == said
    (profile,) = blocks("codecs.md", "toml")
    file = tmp_path / "run.toml"
    file.write_text(profile)
    options = ckptstore.ManagerOptions.from_table(ckptstore.load_profile(file)["manager"])
    kernel = ckptstore.Zstd(3)
    rules = options.codecs.rules
    assert rules == (("params/*", kernel), ("opt/*", ckptstore.Zstd(1)), ("*", None))


def test_declared_changes_example_runs_as_written(tmp_path: Path) -> None:
    (example,) = [b for b in blocks("incremental.md", "python") if "changed=" in b]
    got, said = run_block(example, tmp_path)
    assert got == said
