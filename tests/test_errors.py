"""Errors: every one is defined in errors.py; messages name their backend and key once."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from ckptstore import errors
from ckptstore.backends.retry import RetryPolicy, retry_async
from ckptstore.errors import RetriesExhaustedError, TransientStorageError


async def test_retries_exhausted_names_backend_and_key_once() -> None:
    async def op(attempt: int) -> None:
        raise TransientStorageError("read failed: reset", backend="s3://b/run", key="7/x")

    with pytest.raises(RetriesExhaustedError) as info:
        await retry_async(op, RetryPolicy(max_attempts=2, base_delay=0.001))
    text = str(info.value)
    assert text == "gave up after 2 attempts: read failed: reset (backend s3://b/run, key '7/x')"
    assert info.value.message == "gave up after 2 attempts: read failed: reset"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("ckptstore.format.tree", "TreeError"),
        ("ckptstore.format.leaves", "UnsupportedLeafError"),
        ("ckptstore.checkpoint.partial", "DuplicateLeafError"),
        ("ckptstore.lifecycle.staging", "StagingBudgetError"),
        ("ckptstore.orbax.metadata", "OrbaxExportError"),
        ("ckptstore.importers.safetensors", "SafetensorsError"),
    ],
)
def test_errors_live_in_errors_py_and_keep_their_old_import_paths(module: str, name: str) -> None:
    cls = getattr(errors, name)
    assert cls.__module__ == "ckptstore.errors" and issubclass(cls, errors.CkptStoreError)
    assert getattr(importlib.import_module(module), name) is cls


def test_no_exception_class_is_defined_outside_errors_py() -> None:
    """Only the shipped test helpers (`ckptstore.testing`: injected faults) define their own."""
    package = Path(errors.__file__).parent
    found = []
    for path in package.rglob("*.py"):
        if path.name == "errors.py" or "testing" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [b.id for b in getattr(node, "bases", []) if isinstance(b, ast.Name)]
            if any(b.endswith(("Error", "Exception")) for b in bases):
                found.append(f"{path.relative_to(package)}: {node.name}")
    assert not found
