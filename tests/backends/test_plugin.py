"""The pytest plugin as a downstream project sees it: cheap to load, plain URLs reach the
emulators, async tests and fixtures need no configuration."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import ckptstore
from ckptstore.testing import plugin
from ckptstore.testing.servers import FakeGcsServer, MotoS3Server
from tests.backends.helpers import clean_env

HEAVY = ("jax", "jaxlib", "tensorstore", "numpy", "s3fs", "gcsfs", "botocore")


def test_loading_the_plugin_imports_neither_jax_nor_tensorstore() -> None:
    code = (
        "import sys, ckptstore, ckptstore.testing.plugin\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


async def test_plain_urls_reach_the_emulators(
    ckptstore_s3_bucket: str, ckptstore_gcs_bucket: str
) -> None:
    tree = {"w": np.arange(8, dtype=np.float32)}
    for url in (f"s3://{ckptstore_s3_bucket}/run", f"gs://{ckptstore_gcs_bucket}/run"):
        await ckptstore.save(url, tree, step=2)
        assert await ckptstore.list_steps(url) == [2]
        np.testing.assert_array_equal((await ckptstore.restore(url))["w"], tree["w"])


def test_s3_endpoint_is_set_for_the_test_only(
    ckptstore_s3_server: MotoS3Server, ckptstore_gcs_server: FakeGcsServer
) -> None:
    """Without ``ckptstore_s3_bucket`` no endpoint leaks in from another test."""
    assert "AWS_ENDPOINT_URL_S3" not in os.environ
    assert os.environ["STORAGE_EMULATOR_HOST"] == ckptstore_gcs_server.endpoint
    assert os.environ["AWS_REGION"] == "us-east-1" and os.environ["AWS_CONFIG_FILE"]


def docstring_example() -> str:
    (example,) = re.findall(
        r"Example, with no configuration at all::\n\n(.*?)\n\n[A-Z]", plugin.__doc__ or "", re.S
    )
    return textwrap.dedent(example)


DOWNSTREAM_CONFTEST = """
import os
import sys

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# The plugin is loaded before this file: it must not have imported JAX or TensorStore.
LOADED = sorted(m for m in ("jax", "jaxlib", "tensorstore") if m in sys.modules)
assert not LOADED, f"imported before conftest.py: {LOADED}"


@pytest.fixture
def s3_bucket():
    return "the project's own"  # a common name: the plugin's fixtures do not take it
"""

DOWNSTREAM_GCS_TEST = """
import jax
import numpy as np

import ckptstore


async def test_gcs_plain_url(ckptstore_gcs_bucket, s3_bucket):
    url = f"gs://{ckptstore_gcs_bucket}/run"
    await ckptstore.save(url, {"x": np.ones(3)}, step=7)
    assert await ckptstore.list_steps(url) == [7]
    assert jax.default_backend() == "cpu"
    assert s3_bucket == "the project's own"
"""


def test_a_downstream_project_uses_only_the_plugin(tmp_path: Path) -> None:
    """A project with its own conftest.py and no pytest configuration at all."""
    project = tmp_path / "downstream"
    project.mkdir()
    (project / "conftest.py").write_text(DOWNSTREAM_CONFTEST)
    (project / "test_s3.py").write_text(docstring_example())  # the plugin's own example
    (project / "test_gcs.py").write_text(DOWNSTREAM_GCS_TEST)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
    assert "Unclosed" not in proc.stdout + proc.stderr
    assert "warning" not in (proc.stdout + proc.stderr).lower()  # pytest-asyncio's loop scope


def run_pytest(project: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, str(project)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_a_project_s_own_loop_scope_is_kept(tmp_path: Path) -> None:
    """The plugin fills in pytest-asyncio's fixture loop scope only when nobody set it."""
    (tmp_path / "test_async.py").write_text("async def test_it():\n    pass\n")
    quiet = run_pytest(tmp_path, "-v")
    assert "asyncio_default_fixture_loop_scope=function" in quiet
    assert "PytestDeprecationWarning" not in quiet
    own = run_pytest(tmp_path, "-v", "-o", "asyncio_default_fixture_loop_scope=module")
    assert "asyncio_default_fixture_loop_scope=module" in own
    off = run_pytest(tmp_path, "-v", "-o", "ckptstore_asyncio=false", "-o", "asyncio_mode=auto")
    assert '"asyncio_default_fixture_loop_scope" is unset' in off  # turned off: not ours


def test_claiming_async_tests_can_be_turned_off(tmp_path: Path) -> None:
    (tmp_path / "test_async.py").write_text("async def test_never_awaited():\n    pass\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "ckptstore_asyncio=false",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode != 0  # pytest refuses an async test no plugin runs
    assert "async def functions are not natively supported" in proc.stdout


def test_every_plugin_fixture_is_prefixed(tmp_path: Path) -> None:
    """What ``pytest --fixtures`` lists from the plugin: only ``ckptstore_*`` names."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--fixtures", "-q", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    section = proc.stdout.split("fixtures defined from ckptstore.testing.plugin")[1]
    names = re.findall(r"^(\w+)(?: \[\w+ scope\])? -- ", section.split("\n---")[0], re.M)
    assert sorted(names) == [
        "ckptstore_gcs_bucket",
        "ckptstore_gcs_server",
        "ckptstore_s3_bucket",
        "ckptstore_s3_server",
    ]
