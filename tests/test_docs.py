"""The examples in the docs stay true.

Every ```python block of README.md and docs/*.md runs in this suite. A block runs as
written, by `test_block_runs_as_written`: in a fresh namespace, with a temporary working
directory (and `tempfile`'s), its ``"/tmp/NAME"`` paths moved below it, and every
``print(...)  # output`` (or a print with its output on the comment line below) checked.
Unless the line right above the block is a marker naming the test that runs it instead:

    <!-- fragment: tests/test_docs.py::test_name -->
        The block does not run alone: it awaits at the top level, or needs a checkpoint or
        names from the text around it, or would write gigabytes. The test completes it
        (supplies what it lacks, scales it down, says which) and runs it.
    <!-- as written: tests/test_docs.py::test_name -->
        The block runs alone; the test runs it as written and checks more than its prints
        (runs it twice, against Orbax too, ...), so it is not run twice.

`test_every_python_block_is_run` holds the docs to this: each marker sits right above a
python block and names a test that exists, in a file that names that document; every
other python block is one `test_block_runs_as_written` runs, and compiles and binds every
name it reads; no python hides in a block tagged ```py or not tagged at all.
Shell blocks (```sh, untagged usage lines) are not run here, except where a test says so.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import io
import re
import symtable
import tempfile
import textwrap
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import ckptstore
from ckptstore.importers.safetensors import load_rules
from tests.helpers import DOCS, run_block

REPO = DOCS.parent
DOC_FILES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
MARKER = re.compile(r"<!-- (fragment|as written): (tests/[\w/]+\.py)::(test_\w+) -->")


def blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (DOCS / doc).read_text(), re.S)


@dataclass(frozen=True)
class Block:
    """One fenced block of a document."""

    doc: str  # "README.md", "docs/manager.md"
    line: int  # of its opening fence, from 1
    lang: str  # what follows the fence: "python", "toml", "" ...
    code: str
    marker: tuple[str, str, str] | None  # (kind, test file, test name) from the line above

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced(text: str, doc: str) -> list[Block]:
    """The fenced blocks of ``text`` (a document named ``doc``)."""
    found: list[Block] = []
    lines = text.splitlines()
    opened: tuple[int, str] | None = None
    for n, line in enumerate(lines):
        if opened is None and line.startswith("```"):
            opened = (n, line[3:].strip())
        elif opened is not None and line.rstrip() == "```":
            start, lang = opened
            marker = MARKER.fullmatch(lines[start - 1].strip()) if start else None
            code = "".join(f"{row}\n" for row in lines[start + 1 : n])
            found.append(Block(doc, start + 1, lang, code, marker.groups() if marker else None))
            opened = None
    assert opened is None, f"{doc}:{opened[0] + 1}: a fence never closed"
    return found


def python_blocks() -> list[Block]:
    return [
        b
        for path in DOC_FILES
        for b in fenced(path.read_text(), str(path.relative_to(REPO)))
        if b.lang == "python"
    ]


AS_WRITTEN = [b for b in python_blocks() if b.marker is None]


def unbound(code: str) -> set[str]:
    """The names ``code`` reads that it never binds (imports, assigns, defines) and that
    are not builtins: what a script made of it would lack (SyntaxError: not one)."""
    compile(code, "block", "exec", dont_inherit=True)  # `await` at the top level, say
    top = symtable.symtable(code, "block", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    bound |= {s.get_name() for s in top.get_symbols() if s.is_namespace()}  # def, class
    read: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        read |= {
            s.get_name()
            for s in table.get_symbols()
            if s.is_referenced() and (table is top or s.is_global())
        }
        tables += table.get_children()
    return read - bound - set(dir(builtins))


def marker_problems(text: str, doc: str) -> list[str]:
    """What keeps ``text``'s python blocks from all being run: a marker not right above a
    python block, or naming a test that is not there (or does not read ``doc``); a block
    without a marker that cannot run as written (a name it never binds, top-level
    `await`); python in a block not tagged ``python``."""
    name = Path(doc).name
    found = fenced(text, doc)
    problems = []
    marked = [b for b in found if b.marker]
    for b in marked:
        kind, file, test = b.marker or ("", "", "")
        source = (REPO / file).read_text() if (REPO / file).is_file() else ""
        if b.lang != "python":
            problems.append(f"{b}: a marker above a {b.lang or 'untagged'} block")
        elif not re.search(rf"^(async )?def {test}\(", source, re.M):
            problems.append(f"{b}: {kind}: no test {file}::{test}")
        elif name not in source:
            problems.append(f"{b}: {file} never names {name}")
    if len(MARKER.findall(text)) != len(marked):
        problems.append(f"{doc}: a marker that is not right above a fenced block")
    for b in found:
        if b.lang == "python" and not b.marker:
            try:
                missing = unbound(b.code)
            except SyntaxError as e:
                problems.append(f"{b}: does not run as written ({e.msg}): mark it a fragment")
            else:
                if missing:
                    names = ", ".join(sorted(missing))
                    problems.append(f"{b}: never binds {names}: bind them, or mark a fragment")
        elif b.lang in ("py", "python3", "pycon", "ipython"):
            problems.append(f"{b}: ```{b.lang}: tag it python")
        elif not b.lang and re.search(r"^(import \w|from [\w.]+ import )", b.code, re.M):
            problems.append(f"{b}: python in an untagged block")
    return problems


def test_every_python_block_is_run() -> None:
    every = python_blocks()
    assert len(every) > 20 and len(AS_WRITTEN) > 5
    kinds = {b.marker[0] for b in every if b.marker}
    assert kinds == {"fragment", "as written"}
    problems = [p for path in DOC_FILES for p in marker_problems(path.read_text(), str(path))]
    assert not problems, "\n".join(problems)
    # Each python block is run as written by test_block_runs_as_written, or by the test
    # its marker names.
    for b in every:
        assert (b in AS_WRITTEN) != (b.marker is not None), b
    # ... and what is wrong is found: a test that is not there, a stray marker, a fragment
    # without its marker, a block in disguise.
    wrong = textwrap.dedent("""\
        <!-- fragment: tests/test_docs.py::test_no_such_test -->
        ```python
        x = await y
        ```

        <!-- as written: tests/test_docs.py::test_every_python_block_is_run -->

        ```python
        import os
        ```

        ```python
        session = await ckptstore.partial_save(target, step=0)
        ```

        ```python
        import numpy as np
        f = lambda: np.asarray(state, like=jnp)
        for step in range(3):
            mgr.save(step, state)
        ```

        ```
        import os
        ```
        """)
    assert [p.split(": ", 1)[1] for p in marker_problems(wrong, "docs/x.md")] == [
        "fragment: no test tests/test_docs.py::test_no_such_test",
        "a marker that is not right above a fenced block",
        "does not run as written ('await' outside function): mark it a fragment",
        "never binds jnp, mgr, state: bind them, or mark a fragment",
        "python in an untagged block",
    ]
    elsewhere = "tests/backends/test_conformance_downstream.py"  # testing.md's, not ours
    marker = f"<!-- as written: {elsewhere}::test_a_third_party_backend_runs_the_shipped_suite -->"
    assert marker_problems(f"{marker}\n```python\npass\n```\n", "docs/manager.md") == [
        f"docs/manager.md:2: {elsewhere} never names manager.md"
    ]
    # The page's markers taken away, its three fragments that await at the top level are
    # found here. (Other fragments, unmarked, fail in test_block_runs_as_written: no
    # checkpoint at /ckpt, no imported run; `build` only defines a coroutine.)
    unmarked = MARKER.sub("", (DOCS / "partial-saves.md").read_text())
    found = [p.split(": ", 1)[1] for p in marker_problems(unmarked, "docs/partial-saves.md")]
    assert found == ["does not run as written ('await' outside function): mark it a fragment"] * 3


@pytest.mark.parametrize("block", AS_WRITTEN, ids=str)
def test_block_runs_as_written(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    got, said = run_block(block.code, tmp_path, str(block))
    assert got == said


def completed(code: str, *names: str) -> Callable[..., Coroutine[Any, Any, dict[str, Any]]]:
    """A fragment that awaits at the top level, as the body of a coroutine function taking
    ``names`` (with ``ckptstore`` imported, as the page's first block did): called, it runs
    the block and returns the block's names."""
    params = ", ".join(names)
    source = f"async def block({params}):\n{textwrap.indent(code, '    ')}    return locals()\n"
    namespace: dict[str, Any] = {"ckptstore": ckptstore}
    exec(compile(source, "fragment", "exec", dont_inherit=True), namespace)
    block: Callable[..., Coroutine[Any, Any, dict[str, Any]]] = namespace["block"]
    return block


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
    exec(
        compile(code.replace("print(", "result = ("), "example", "exec", dont_inherit=True),
        namespace,
    )
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
    (code,) = re.findall(r"## Quick start\n\n(?:<!--.*-->\n)?```python\n(.*?)```", readme, re.S)
    for _ in range(2):  # a second run works as the first did
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(
                compile(code, "README quick start", "exec", dont_inherit=True),
                {"__name__": "readme"},
            )
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
        found = re.findall(r"(?<![\w/.])((?:\w+/)*\w+\.py)\b", line)  # codecs/zstd.py too
        named.setdefault(folder, set()).update(found)
    assert set(counted) <= set(named) and len(named) > 10
    for folder, names in named.items():
        top = PACKAGE / folder
        files = top.rglob("*.py") if folder else top.glob("*.py")
        modules = {p.relative_to(top).as_posix() for p in files}
        assert names <= modules, (folder, names - modules)
        if folder:
            loose = {m for m in modules - names if m.rsplit("/", 1)[-1] != "__init__.py"}
            assert loose <= {"__main__.py"}, (folder, loose)
        mine = {m for m in modules if m.rsplit("/", 1)[-1] != "__init__.py"}
        assert counted.get(folder, len(mine)) == len(mine), (folder, counted[folder], mine)


def test_codecs_profile_is_valid(tmp_path: Path) -> None:
    (profile,) = [b for b in blocks("codecs.md", "toml") if "[manager" in b]
    file = tmp_path / "run.toml"
    file.write_text(profile)
    options = ckptstore.ManagerOptions.from_table(ckptstore.load_profile(file)["manager"])
    kernel = ckptstore.Zstd(3)
    rules = options.codecs.rules
    assert rules == (("params/*", kernel), ("opt/*", ckptstore.Zstd(1)), ("*", None))


# ---- docs/partial-saves.md: its blocks await at the top level ----


def partial_saves_block(contains: str) -> str:
    (block,) = [b for b in blocks("partial-saves.md", "python") if contains in b]
    return block


def test_partial_save_example_builds_a_step(tmp_path: Path) -> None:
    """The session of 32 layers and an embedding, each part 64 MiB there, here 512 B."""
    example = partial_saves_block("async def build(target):")
    code = example.replace("(4096, 4096)", "(16, 8)").replace("(32000, 4096)", "(32, 8)")
    assert code.count("(16, 8)") == code.count("(32, 8)") == 1  # what is scaled down
    namespace: dict[str, Any] = {}
    exec(compile(code, "partial-saves.md", "exec", dont_inherit=True), namespace)
    target = str(tmp_path / "run")
    asyncio.run(namespace["build"](target))
    tree = ckptstore.restore_sync(target, 0)
    assert sorted(tree["layers"], key=int) == [str(i) for i in range(32)]
    assert tree["layers"]["31"]["w"].shape == (16, 8) and tree["embed"].shape == (32, 8)
    assert ckptstore.verify_sync(target).ok


def test_partial_save_resume_example_finds_the_parts(tmp_path: Path) -> None:
    """A session whose process died after its first part, opened again as the docs say."""
    resume = completed(partial_saves_block("# the newest uncommitted session"), "target")
    target = str(tmp_path / "run")
    a, b = np.arange(4.0), np.ones(3, np.float32)

    async def died_then_resumed() -> tuple[str, dict[str, Any]]:
        async with await ckptstore.partial_save(target, step=0) as dead:
            await dead.add({"a": a})  # then the process dies: no finalize
        names = await resume(target)
        session = names["session"]
        await session.add({"b": b})  # continue adding what is missing
        await session.finalize()
        await session.close()
        return dead.attempt, names

    attempt, names = asyncio.run(died_then_resumed())
    session = names["session"]
    assert session.attempt == attempt and [p.index for p in session.parts] == [0, 1]
    restored = ckptstore.restore_sync(target, 0)
    assert restored["a"].tobytes() == a.tobytes() and restored["b"].tobytes() == b.tobytes()


def test_incremental_partial_save_example_references_the_base(tmp_path: Path) -> None:
    """A frozen leaf that step 7 holds, added to a session with base=7: referenced."""
    incremental = completed(partial_saves_block("base=7)"), "target", "frozen")
    target = str(tmp_path / "run")
    frozen = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "norm": np.ones(8)}
    step7 = ckptstore.save_sync(target, {"base": frozen}, step=7)

    async def run() -> dict[str, Any]:
        names = await incremental(target, frozen)
        session = names["session"]
        await session.add({"adapters": np.zeros(4, np.float32)})
        await session.finalize()
        await session.close()
        return names

    part = asyncio.run(run())["part"]
    assert set(part.refs) == {"base/w", "base/norm"}  # nothing of the base written again
    assert {(r.step, r.attempt) for r in part.refs.values()} == {(7, step7.attempt)}
    restored = ckptstore.restore_sync(target, 8)
    assert restored["base"]["w"].tobytes() == frozen["w"].tobytes()


def test_import_safetensors_example_runs_on_s3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ckptstore_s3_bucket: str
) -> None:
    """The Python import, of a four-tensor model with the page's rule file, into a bucket
    on moto's S3 server (the block's ``s3://models/``)."""
    from safetensors.numpy import save_file

    example = partial_saves_block("import_safetensors(")
    assert '"s3://models/llama"' in example
    code = example.replace("s3://models/", f"s3://{ckptstore_s3_bucket}/")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    up = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensors = {
        "model.layers.3.mlp.up.weight": up,
        "model.norm.scale": np.full(3, 0.5, np.float32),
        "model.embed.weight": np.ones((4, 2), np.float32),
        "lm_head.weight": np.zeros((2, 2), np.float32),
    }
    save_file(tensors, str(tmp_path / "llama" / "model.safetensors"))
    (tmp_path / "rules.toml").write_text(blocks("partial-saves.md", "toml")[0])

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        asyncio.run(completed(code)())
    assert printed.getvalue().split() == ["3", "1", "1"]  # tensors, skipped (lm_head), parts
    got = ckptstore.restore_sync(f"s3://{ckptstore_s3_bucket}/llama", 0)
    assert got["layers"]["3"]["up"]["kernel"].tobytes() == up.T.tobytes()  # transposed
    assert str(got["final_norm"]["scale"].dtype) == "bfloat16"
    assert sorted(got) == ["final_norm", "layers", "model"]
