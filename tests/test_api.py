"""The public surface: `__all__` comes from one list (`ckptstore._PUBLIC` plus the errors),
the imports type checkers read say the same, and each operation is defined once."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import ckptstore
from ckptstore import errors


def _type_checking_imports() -> dict[str, set[str]]:
    tree = ast.parse(Path(ckptstore.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    found: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return found


def test_the_type_checkers_imports_are_the_public_list() -> None:
    public = {module: set(names) for module, names in ckptstore._PUBLIC.items()}
    assert _type_checking_imports() == public


def test_all_is_the_public_list_and_the_errors() -> None:
    assert sorted(ckptstore.__all__) == sorted(
        [*errors.__all__, *(n for names in ckptstore._PUBLIC.values() for n in names)]
    )
    for name in ckptstore.__all__:
        assert getattr(ckptstore, name) is not None
    for name in errors.__all__:  # every error class in errors.py is public
        assert issubclass(getattr(ckptstore, name), errors.CkptStoreError)


def test_dir_shows_the_public_names_not_the_modules_helpers() -> None:
    shown = dir(ckptstore)
    assert {"Any", "TYPE_CHECKING", "annotations", "importlib"}.isdisjoint(shown)
    assert set(ckptstore.__all__) <= set(shown)
    assert [n for n in shown if not n.startswith("__")] == sorted(ckptstore.__all__)


def test_every_error_class_is_listed() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)


def test_each_operation_is_defined_once_in_api() -> None:
    """The public operations are `ckptstore.api`'s own functions (not re-exports of a
    same-named function elsewhere; the Orbax ones `ckptstore.api.orbax`'s), except
    `promote`, which is the tiers' own."""
    for module in ("ckptstore.api", "ckptstore.api.orbax"):
        for name in ckptstore._PUBLIC[module]:
            value = getattr(ckptstore, name)
            if name in {"promote", "Promotion"}:
                assert value.__module__ == "ckptstore.tiers.promote"
            else:
                assert value.__module__ == module, name


def test_each_twin_stands_beside_its_async_function() -> None:
    names = [*ckptstore._PUBLIC["ckptstore.api"], *ckptstore._PUBLIC["ckptstore.api.orbax"]]
    for name in names:
        if not name.endswith("_sync"):
            continue
        twin = getattr(ckptstore, name)
        fn = getattr(ckptstore, name.removesuffix("_sync"))
        assert inspect.signature(twin).parameters == inspect.signature(fn).parameters
        assert inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(twin)


def test_the_old_homes_are_gone() -> None:
    for module in (
        "ckptstore.checkpoint.blocking",
        "ckptstore.checkpoint.tiered",
        "ckptstore.lifecycle.tiers",
        "ckptstore.importers.orbax_export",
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        raise AssertionError(f"{module} still exists")


def test_every_public_name_loads_in_a_fresh_process() -> None:
    """Each name by itself, as a user's first import would (no other module loaded it)."""
    import subprocess
    import sys

    names = [n for names in ckptstore._PUBLIC.values() for n in names]
    code = "; ".join(f"from ckptstore import {n}" for n in names) + "; print('ok')"
    for name in ("policies", "CheckpointManager"):  # alone, too
        one = subprocess.run(
            [sys.executable, "-c", f"from ckptstore import {name}"], capture_output=True, text=True
        )
        assert one.returncode == 0, one.stderr
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr
