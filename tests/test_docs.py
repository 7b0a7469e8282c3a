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

DOCS = Path(__file__).resolve().parents[1] / "docs"


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


PRINTED = re.compile(r"^\s*print\(.*\)\s*#\s*(.*)$")


def run_block(code: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Run one example (its /tmp/ paths moved below ``tmp_path``): (what it printed, what
    its ``print(...)  # comment`` lines say it prints)."""
    for name in set(re.findall(r'"/tmp/([\w-]+)"', code)):
        code = code.replace(f'"/tmp/{name}"', repr(str(tmp_path / name)))
    assert '"/tmp/' not in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/migrating-from-orbax.md", "exec"), {"__name__": "example"})
    lines = [line for line in code.splitlines() if line.lstrip().startswith("print(")]
    expected = [m[1] for line in lines if (m := PRINTED.match(line))]
    assert len(expected) == len(lines), "every print(...) says what it prints"
    return printed.getvalue().splitlines(), expected


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
