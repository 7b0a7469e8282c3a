"""The built wheel, installed into a fresh virtual environment next to another JAX version in
the supported range (the range's floor; CI pins another), imports, saves and restores on
local disk, runs ``ckptstore --version``, and needs neither s3fs nor gcsfs.

A fresh environment downloads (or unpacks from pip's cache) jax, jaxlib, TensorStore, numpy
and scipy: about 1.5 minutes on the 2-core CI machine even with a warm cache, too slow for
``make test``. It runs with ``CKPTSTORE_WHEEL_TEST=1`` (``make test-wheel``), and needs the
package index.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("CKPTSTORE_WHEEL_TEST") != "1",
        reason="installs a fresh venv (~1.5 min, needs the package index): "
        "CKPTSTORE_WHEEL_TEST=1 or make test-wheel",
    ),
]

IN_THE_NEW_VENV = """
import importlib.util, json, sys, tempfile

import jax
import numpy as np

import ckptstore

root = tempfile.mkdtemp()
tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": {"b": np.ones(3, np.int8)}}
ckptstore.save_sync(root, tree, step=1)
back = ckptstore.restore_sync(root, 1)
try:
    ckptstore.open_backend("s3://bucket/run")
    s3_error = ""
except ckptstore.ConfigError as exc:
    s3_error = str(exc)
print(json.dumps({
    "jax": jax.__version__,
    "ckptstore": ckptstore.__file__,
    "steps": ckptstore.list_steps_sync(root),
    "equal": [np.array_equal(back["w"], tree["w"]), np.array_equal(back["n"]["b"], tree["n"]["b"])],
    "verified": ckptstore.verify_sync(root, 1).ok,
    "s3fs": importlib.util.find_spec("s3fs") is not None,
    "s3_error": s3_error,
}))
"""


def jax_floor() -> str:
    """The lowest JAX version the package's dependency range allows."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if re.match(r"jax\b", d)]
    (floor,) = re.findall(r">=\s*([\w.]+)", spec)
    return str(floor)


def run(*args: str | Path, **kw: Any) -> str:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return str(proc.stdout)


def test_the_wheel_installs_next_to_another_jax(tmp_path: Path) -> None:
    version = jax_floor()
    assert version != jax.__version__, "pick a JAX other than the one CI pins"
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, ROOT)
    (wheel,) = dist.glob("ckptstore-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", wheel, f"jax=={version}", f"jaxlib=={version}")
    run(python, "-m", "pip", "check")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)
    report = json.loads(run(python, "-c", IN_THE_NEW_VENV, cwd=tmp_path, env=env))
    assert report["jax"] == version
    assert report["ckptstore"].startswith(str(venv))  # the installed wheel, not this checkout
    assert report["steps"] == [1] and report["equal"] == [True, True] and report["verified"]
    assert not report["s3fs"] and "pip install 'ckptstore[s3]'" in report["s3_error"]
    assert run(venv / "bin" / "ckptstore", "--version", env=env).strip() == "ckptstore 0.1.0"
