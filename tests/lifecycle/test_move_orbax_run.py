"""docs/migrating-from-orbax.md, "Move an existing run", run as written: a real Orbax 0.12.8
Composite run (a model, an optimizer state, a JSON config) imported with the commands the
page gives, then continued by a ckptstore manager that restores every item and saves two
more steps, which restore."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.cli.main import main
from tests.helpers import DOCS, run_block

SECTION = re.compile(r"## Move an existing run\n(.*?)(?:\n## |\Z)", re.S)


def section() -> str:
    (text,) = SECTION.findall((DOCS / "migrating-from-orbax.md").read_text())
    return text


def test_moving_a_composite_orbax_run_as_the_docs_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = section()
    orbax_run, continued, in_place = re.findall(r"```python\n(.*?)```", text, re.S)
    (commands,) = re.findall(r"```sh\n(.*?)```", text, re.S)
    assert orbax_run.startswith("# The Orbax run to move\n") and "ocp.args.JsonSave" in orbax_run
    assert "import orbax" not in continued

    run_block(orbax_run, tmp_path)  # the real Orbax run
    src, dst = tmp_path / "orbax-composite", tmp_path / "ckptstore-moved"
    assert ckptstore.list_steps_sync(src) == [10, 20]
    lines = [line for line in commands.splitlines() if line.strip()]
    assert [line.split()[:2] for line in lines] == [
        ["ckptstore", "ls"],
        ["ckptstore", "import-orbax"],
        ["ckptstore", "verify"],
    ]
    for line in lines:
        argv = shlex.split(line.replace("/tmp/", f"{tmp_path}/"))
        assert main(argv[1:]) == 0, line
    listed = capsys.readouterr().out
    assert "config,model,opt" in listed and "imported" in listed

    imported = ckptstore.read_manifest_sync(dst, 20)
    assert imported.item_names == ["config", "model", "opt"]
    got, said = run_block(continued, tmp_path)  # continuing in ckptstore
    assert got == said == ["20 mlp 16.0", "[20, 21, 22]", "0.0", "2"]

    # Every item of the continued steps, and the imported one, restores as it was saved.
    assert ckptstore.list_steps_sync(dst) == [20, 21, 22]
    for step, w, count in ((20, 1.0, 0), (21, 0.5, 1), (22, 0.0, 2)):
        model = ckptstore.restore_sync(dst, step, item="model")
        opt = ckptstore.restore_sync(dst, step, item="opt")
        np.testing.assert_array_equal(model["w"], np.full((4, 4), w, np.float32))
        assert model["w"].dtype == np.float32 and opt["count"] == count
        np.testing.assert_array_equal(opt["mu"]["b"], np.zeros(4, np.float32))
        config = ckptstore.restore_sync(dst, step, item="config")
        assert config == {"lr": 0.5, "model": "mlp", "layers": [4, 4]}
    assert ckptstore.list_steps_sync(src) == [10, 20]  # the Orbax run is untouched

    # Continuing from the Orbax root in place, into a new root.
    assert "import orbax" not in in_place
    got, said = run_block(in_place, tmp_path)
    assert got == said == ["[21, 22]", "2 mlp"]
    again = tmp_path / "ckptstore-continued"
    model = ckptstore.restore_sync(again, 22, item="model")
    np.testing.assert_array_equal(model["w"], np.zeros((4, 4), np.float32))
    assert ckptstore.list_steps_sync(src) == [10, 20]
