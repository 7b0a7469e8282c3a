"""The shipped conformance suite as a third-party backend's author uses it: the example
backend of docs/testing.md, in a throwaway project with no pytest configuration, passes
`ckptstore.testing.conformance.BackendTests`; a copy whose create overwrites fails exactly
the create tests."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.backends.helpers import clean_env

DOCS = Path(__file__).resolve().parents[2] / "docs"

OVERWRITING = """
import pytest

from ckptstore.testing.conformance import BackendTests
from test_dir_backend import DirBackend


class OverwritingBackend(DirBackend):
    async def _create(self, key, data):
        await self._write(key, data)  # no create-if-absent: two committers could both win


class TestOverwritingBackend(BackendTests):
    @pytest.fixture
    async def backend(self, tmp_path):
        async with OverwritingBackend(tmp_path / "root") as b:
            yield b
"""

NO_JAX = """
import sys


def test_the_suite_did_not_import_jax():
    assert "jax" not in sys.modules
"""

CREATE_TESTS = {
    "test_create_new_then_exists",
    "test_create_over_written_object",
    "test_concurrent_creators_one_wins",
    "test_lost_create_reply_is_recognised",
}


def outcomes(report: Path) -> dict[tuple[str, str], str]:
    """(class, test) -> passed / failed / skipped, from pytest's JUnit XML."""
    out: dict[tuple[str, str], str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        out[(case.get("classname", "").rsplit(".", 1)[-1], case.get("name", ""))] = kind
    return out


def test_a_third_party_backend_runs_the_shipped_suite(tmp_path: Path) -> None:
    (example,) = re.findall(r"```python\n(.*?)```", (DOCS / "testing.md").read_text(), re.S)
    project = tmp_path / "thirdparty"
    project.mkdir()
    (project / "test_dir_backend.py").write_text(example)
    (project / "test_overwriting.py").write_text(OVERWRITING)
    (project / "test_imports.py").write_text(NO_JAX)
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    results = outcomes(report)
    good = {name: kind for (cls, name), kind in results.items() if cls == "TestDirBackend"}
    bad = {name: kind for (cls, name), kind in results.items() if cls == "TestOverwritingBackend"}
    assert len(good) > 30, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert set(good.values()) == {"passed"}, proc.stdout[-3000:]
    assert bad.keys() == good.keys()  # the same suite ran against both
    assert {name for name, kind in bad.items() if kind != "passed"} == CREATE_TESTS
    assert {bad[name] for name in CREATE_TESTS} == {"failure"}
    assert results[("test_imports", "test_the_suite_did_not_import_jax")] == "passed"
    assert proc.returncode == 1  # pytest reports the failures
