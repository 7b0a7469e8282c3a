"""Hostile inputs: each is refused with a typed `CkptStoreError` naming what is wrong.

Hand-edited manifests, commit markers and part records; profiles; safetensors files;
step directory names; a file where the root should be; a read-only root; a step
directory that leads out of the root. For each: nothing is committed, nothing is
written outside the root, and (where a step is damaged) the good step still restores
and `ckptstore ls` names the bad one and lists the other. The cases are the test ids
(tests/campaigns/hostile_cases.py); `test_the_count` adds those other files cover.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.cli import main as cli
from ckptstore.errors import SafetensorsError
from ckptstore.importers.safetensors import find_tensors, import_safetensors
from ckptstore.protocol import digest
from tests.campaigns import hostile_cases as cases

TREES = {s: {"x": np.arange(4.0) + s, "n": {"y": np.full(3, s, np.int32)}} for s in (1, 2)}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template") / "ckpt"
    for step, tree in TREES.items():
        ckptstore.save_sync(str(root), tree, step=step)
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    """Steps 1 and 2, good, in a fresh copy."""
    out = tmp_path / "ckpt"
    shutil.copytree(template, out)
    return out


def outside(tmp: Path, root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``tmp`` that is not below ``root``, with its size and mtime."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in tmp.rglob("*")
        if p.is_file() and root not in p.parents
    }


def exact(restored: Any, tree: Any) -> bool:
    if isinstance(tree, dict):
        return (
            isinstance(restored, dict)
            and restored.keys() == tree.keys()
            and all(exact(restored[k], tree[k]) for k in tree)
        )
    return bool(restored.dtype == tree.dtype and restored.tobytes() == tree.tobytes())


def refused(
    root: Path, action: Callable[[], Any], error: type[Exception], match: str
) -> pytest.ExceptionInfo[Exception]:
    """``action`` raises ``error`` (a `CkptStoreError`) matching ``match``; nothing was
    committed and nothing written outside the root meanwhile."""
    assert issubclass(error, ckptstore.CkptStoreError)
    tmp = root.parent
    before, steps = outside(tmp, root), _steps(root)
    with pytest.raises(error, match=match) as info:
        action()
    assert _steps(root) == steps, "a step was committed or lost"
    assert outside(tmp, root) == before, "something was written outside the root"
    return info


def _steps(root: Path) -> list[int] | str:
    try:
        return ckptstore.list_steps_sync(str(root))
    except ckptstore.CkptStoreError as exc:
        return type(exc).__name__


def step_one_survives(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 1 restores bit-exact; `ckptstore ls` lists it, and names step 2 as bad where
    its marker or manifest is (`ls` reads no array data: `verify` finds the rest)."""
    assert exact(ckptstore.restore_sync(str(root), step=1), TREES[1])
    try:
        asyncio.run(ckptstore.read_manifest(str(root), 2))
        unreadable = False
    except ckptstore.CorruptCheckpointError:
        unreadable = True
    capsys.readouterr()
    assert cli(["ls", str(root)]) == int(unreadable)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "CORRUPT" not in rows["1"] and ("CORRUPT" in rows["2"]) == unreadable, rows


def resign(root: Path, step: int, data: bytes) -> None:
    """Replace ``step``'s manifest and fix its marker's digest: a forger's edit."""
    (attempt,) = (root / str(step)).glob("attempt-*")
    (attempt / "manifest.json").write_bytes(data)
    marker = json.loads((root / str(step) / "COMMITTED").read_bytes())
    marker["manifest_digest"] = digest(data)
    (root / str(step) / "COMMITTED").write_text(json.dumps(marker))


def edited(path: Path, edit: Callable[[dict[str, Any]], Any]) -> bytes:
    doc = json.loads(path.read_bytes())
    out = edit(doc)
    return out if isinstance(out, bytes) else json.dumps(doc).encode()


# ---- manifests and markers ----


@pytest.mark.parametrize("case", list(cases.MANIFESTS))
def test_hostile_manifest(case: str, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, match = cases.MANIFESTS[case]
    (attempt,) = (root / "2").glob("attempt-*")
    resign(root, 2, edited(attempt / "manifest.json", edit))
    err = ckptstore.CorruptCheckpointError
    refused(root, lambda: ckptstore.restore_sync(str(root), step=2), err, f"(?i){match}")
    assert not ckptstore.verify_sync(str(root), step=2).ok
    step_one_survives(root, capsys)


@pytest.mark.parametrize("case", list(cases.MARKERS))
def test_hostile_marker(case: str, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, match = cases.MARKERS[case]
    (root / "2" / "COMMITTED").write_bytes(data)
    err = ckptstore.CorruptCheckpointError
    refused(root, lambda: ckptstore.restore_sync(str(root), step=2), err, f"(?i){match}")
    refused(root, lambda: asyncio.run(ckptstore.gc(str(root), older_than=0)), err, "marker")
    step_one_survives(root, capsys)


BIG_LEAF = textwrap.dedent(
    """
    import resource, sys
    limit = 4 << 30  # address space: a 256 GiB allocation fails here instead of swapping
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import ckptstore
    from ckptstore.cli import main
    root = sys.argv[1]
    try:
        ckptstore.restore_sync(root, step=2)
    except ckptstore.CorruptCheckpointError as exc:
        print("restore:", exc)
    report = ckptstore.verify_sync(root, step=2)
    print("verify:", report.ok, list(report.problems.values()))
    print("ls:", main(["ls", root]))
    """
)


def test_a_manifest_declaring_a_256_gib_leaf_allocates_nothing(root: Path) -> None:
    """Refused before any buffer is sized by it, in a process that cannot map even 4 GiB
    (a bad_alloc would abort it): leaf x is packed, and packs hold only small leaves, so
    the manifest itself is refused (a leaf in an OCDBT store is checked against its
    stored ``zarr.json`` first)."""
    (attempt,) = (root / "2").glob("attempt-*")
    big = 256 << 30

    def declare(doc: dict[str, Any]) -> None:
        cases.leaf(doc).update(shape=[big // 8], chunk_shape=[big // 8])

    resign(root, 2, edited(attempt / "manifest.json", declare))
    proc = subprocess.run(
        [sys.executable, "-c", BIG_LEAF, str(root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("restore:") and "shape" in lines[0], proc.stdout
    assert lines[1].startswith("verify: False"), proc.stdout
    # `ls` reads no array data, but it parses the manifest: step 2 is listed as corrupt.
    assert lines[-1] == "ls: 1" and any(line.split()[:1] == ["1"] for line in lines), proc.stdout
    assert any(line.split()[:2] == ["2", "CORRUPT:"] for line in lines), proc.stdout


# ---- partial-save records ----


@pytest.fixture
def session_of_step_3(root: Path) -> Path:
    """An unfinished partial save of step 3 with two parts; returns part 1's record."""

    async def start() -> str:
        session = await ckptstore.partial_save(str(root), step=3)
        await session.add({"a": np.arange(4.0)})
        await session.add({"b": np.ones(2)})
        return session.attempt

    attempt = asyncio.run(start())
    return root / "3" / attempt / "state" / "parts" / "1.json"


@pytest.mark.parametrize("case", list(cases.PART_RECORDS))
def test_hostile_part_record(case: str, root: Path, session_of_step_3: Path) -> None:
    edit, match = cases.PART_RECORDS[case]
    session_of_step_3.write_bytes(edited(session_of_step_3, edit))

    def resume_and_finalize() -> None:
        async def run() -> None:
            session = await ckptstore.partial_save(str(root), step=3)
            await session.finalize()

        asyncio.run(run())

    err = ckptstore.CorruptCheckpointError
    refused(root, resume_and_finalize, err, f"(?i){match}")


def test_a_forged_session_record(root: Path, session_of_step_3: Path) -> None:
    session_of_step_3.parents[2].joinpath("SESSION.json").write_text(cases.DEEP)
    err = ckptstore.CorruptCheckpointError
    refused(root, lambda: asyncio.run(ckptstore.partial_save(str(root), step=3)), err, "session")


# ---- profiles, safetensors ----


@pytest.mark.parametrize("case", list(cases.PROFILES))
def test_hostile_profile(case: str, root: Path) -> None:
    text, match = cases.PROFILES[case]
    profile = root.parent / "profile.toml"
    profile.write_bytes(text)
    err = ckptstore.InvalidURLError if "NUL" in match else ckptstore.ConfigError
    tree = {"x": np.arange(3)}
    refused(root, lambda: ckptstore.save_sync(str(profile), tree, step=9), err, match)


@pytest.mark.parametrize("case", list(cases.SAFETENSORS))
def test_hostile_safetensors_file(case: str, root: Path) -> None:
    data, match = cases.SAFETENSORS[case]
    model = root.parent / "model.safetensors"
    model.write_bytes(data)
    refused(root, lambda: find_tensors(model), SafetensorsError, match)

    importing = import_safetensors(model, str(root), step=9)
    refused(root, lambda: asyncio.run(importing), SafetensorsError, match)


SPARSE_TENSOR = textwrap.dedent(
    """
    import asyncio, resource, sys
    limit = 4 << 30  # address space: a 64 GiB buffer fails here (a bare MemoryError, or worse)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import ckptstore
    from ckptstore.importers.safetensors import find_tensors, import_safetensors
    model, root = sys.argv[1], sys.argv[2]
    (ref,) = find_tensors(model)
    print("declared:", ref.nbytes)
    for name, run in (
        ("read", ref.read),
        ("import", lambda: asyncio.run(import_safetensors(model, root, step=9))),
    ):
        try:
            run()
            print(name, "no error")
        except ckptstore.CkptStoreError as exc:
            print(name, type(exc).__name__, exc)
    """
)


def test_a_sparse_safetensors_file_declaring_64_gib_allocates_nothing(root: Path) -> None:
    """A tensor that lies inside its file passes the header's checks; a sparse file can
    make that 64 GiB. Reading it is refused before the buffer is sized, typed, in a
    process that cannot map 4 GiB."""
    big = 64 << 30
    header = json.dumps({"w": {"dtype": "F32", "shape": [big // 4], "data_offsets": [0, big]}})
    model = root.parent / "sparse.safetensors"
    model.write_bytes(cases.safetensors(header.encode(), data=b""))
    with open(model, "r+b") as f:
        f.truncate(8 + len(header) + big)  # a hole: no disk used
    proc = subprocess.run(
        [sys.executable, "-c", SPARSE_TENSOR, str(model), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"declared: {big}", proc.stdout
    for line, name in zip(lines[1:], ("read", "import"), strict=True):
        assert line.startswith(f"{name} InsufficientMemoryError"), proc.stdout
        assert "'w'" in line, line
    assert ckptstore.list_steps_sync(str(root)) == [1, 2]  # nothing committed


def test_a_safetensors_index_naming_a_shard_outside_its_folder(root: Path) -> None:
    index = root.parent / "model" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"weight_map": {"w": "../../elsewhere.safetensors"}}))
    refused(root, lambda: find_tensors(index), SafetensorsError, "outside the model folder")


# ---- step names, roots ----


@pytest.mark.parametrize("name", cases.STEP_NAMES)
def test_a_step_directory_name_that_is_no_step(name: str, root: Path) -> None:
    shutil.copytree(root / "1", root / name)
    assert ckptstore.list_steps_sync(str(root)) == [1, 2]
    assert asyncio.run(ckptstore.gc(str(root), older_than=0)).entries == []
    assert (root / name / "COMMITTED").exists()  # not ours: gc leaves it alone
    assert cli(["ls", str(root)]) == 0


@given(
    name=st.text(
        st.characters(exclude_characters="/\x00", exclude_categories=("Cs",)),
        min_size=1,
        max_size=40,
    )
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_directory_name_is_a_step_only_in_ascii_digits(name: str, template: Path) -> None:
    if name in (".", "..") or len(name.encode()) > 200:
        return
    root = template.parent / "names"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)
    try:
        (root / name).mkdir(exist_ok=True)
        (root / name / "COMMITTED").write_bytes(b"{}")
        is_step = name.isascii() and name.isdigit() and (name == "0" or name[0] != "0")
        listed = ckptstore.list_steps_sync(str(root))
        assert listed == sorted({1, 2} | ({int(name)} if is_step else set()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


OPERATIONS: dict[str, Callable[[str], Any]] = {
    "save": lambda r: ckptstore.save_sync(r, {"x": np.arange(3)}, step=3),
    "partial save": lambda r: asyncio.run(ckptstore.partial_save(r, step=3)),
    "list": lambda r: ckptstore.list_steps_sync(r),
    "restore": lambda r: ckptstore.restore_sync(r),
    "gc": lambda r: asyncio.run(ckptstore.gc(r, older_than=0)),
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_a_file_where_the_root_should_be(operation: str, tmp_path: Path) -> None:
    file = tmp_path / "ckpt"
    file.write_bytes(b"not a directory")
    err = ckptstore.StorageError
    match = "Not a directory|is not a directory|is a file|a file is in the way"
    refused(file, lambda: OPERATIONS[operation](str(file)), err, match)
    assert file.read_bytes() == b"not a directory"
    assert cli(["ls", str(file)]) == 2


READ_ONLY = textwrap.dedent(
    """
    import asyncio, ctypes, os, sys
    if os.geteuid() == 0 and "CKPTSTORE_NO_DAC" not in os.environ:
        # Root writes anywhere: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the
        # bounding set (prctl PR_CAPBSET_DROP), then run again without them.
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):
            if libc.prctl(24, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
        os.environ["CKPTSTORE_NO_DAC"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    import numpy as np
    import ckptstore
    root, op = sys.argv[1], sys.argv[2]
    try:
        if op == "save":
            ckptstore.save_sync(root, {"x": np.arange(3)}, step=3)
        elif op == "partial save":
            asyncio.run(ckptstore.partial_save(root, step=3))
        elif op == "delete":
            asyncio.run(ckptstore.delete_step(root, 2))
        print("no error")
    except ckptstore.CkptStoreError as exc:
        print(type(exc).__name__, exc)
    """
)


@pytest.mark.parametrize("operation", ["save", "partial save", "delete"])
def test_a_read_only_root(operation: str, root: Path) -> None:
    """A real read-only directory (as root, the child runs without CAP_DAC_OVERRIDE)."""
    modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")] if p.is_dir()}
    for path in modes:
        path.chmod(0o555)
    try:
        before = outside(root.parent, root)
        listing = sorted(str(p) for p in root.rglob("*"))
        proc = subprocess.run(
            [sys.executable, "-c", READ_ONLY, str(root), operation],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert proc.stdout.startswith("PermissionDeniedError"), proc.stdout + proc.stderr[-2000:]
    assert "permission denied" in proc.stdout.lower()
    assert sorted(str(p) for p in root.rglob("*")) == listing  # nothing written
    assert outside(root.parent, root) == before
    assert ckptstore.list_steps_sync(str(root)) == [1, 2]


def test_a_step_directory_leading_out_of_the_root(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = root.parent / "elsewhere"
    shutil.copytree(root / "2", elsewhere)
    shutil.rmtree(root / "2")
    (root / "2").symlink_to(elsewhere)
    before = sorted(str(p) for p in elsewhere.rglob("*"))
    refused(
        root,
        lambda: ckptstore.restore_sync(str(root), step=2),
        ckptstore.CorruptCheckpointError,
        "resolves outside the root",
    )
    with pytest.raises(ckptstore.InvalidKeyError, match="outside the root"):
        ckptstore.save_sync(str(root), {"x": np.arange(3)}, step=2)
    assert sorted(str(p) for p in elsewhere.rglob("*")) == before  # nothing written there
    step_one_survives(root, capsys)


# ---- properties ----


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


def fields(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside a JSON document."""
    yield path
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    )
    for key, value in items:
        yield from fields(value, (*path, key))


@given(data=st.data())
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_manifest_field_replaced_is_refused_or_harmless(
    data: st.DataObject, template: Path
) -> None:
    """Replace one field of a re-signed manifest with any JSON value: restore raises a
    `CkptStoreError` or returns exactly what was saved; never another exception."""
    root = template.parent / "fields"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)
    try:
        (attempt,) = (root / "2").glob("attempt-*")
        doc = json.loads((attempt / "manifest.json").read_bytes())
        path = data.draw(st.sampled_from([p for p in fields(doc) if p]))
        value = data.draw(JSON)
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        resign(root, 2, json.dumps(doc).encode())
        try:
            restored = ckptstore.restore_sync(str(root), step=2)
        except ckptstore.CkptStoreError:
            return
        assert exact(restored, TREES[2]), (path, value)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@given(header=JSON)
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_safetensors_header_is_refused_or_consistent(header: Any, tmp_path: Path) -> None:
    """Any JSON header: `SafetensorsError`, or tensors that lie inside the file."""
    model = tmp_path / "any.safetensors"
    model.write_bytes(cases.safetensors(json.dumps(header).encode()))
    try:
        refs = find_tensors(model)
    except SafetensorsError:
        return
    size = model.stat().st_size
    assert all(0 <= r.offset and r.offset + r.nbytes <= size for r in refs)


@given(text=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_profile_is_a_typed_error_or_a_backend(text: bytes, tmp_path: Path) -> None:
    profile = tmp_path / "any.toml"
    profile.write_bytes(text)
    try:
        ckptstore.open_backend(profile=profile)
    except ckptstore.CkptStoreError:
        pass


# ---- the count ----


def _test_function(module: str, test: str) -> Any:
    if "." not in module:  # a test file's name: the folder below tests/ that holds it
        (found,) = Path(__file__).parents[1].glob(f"*/{module}.py")
        module = f"tests.{found.parent.name}.{module}"
    target: Any = importlib.import_module(module)
    for attr in test.split("."):
        target = getattr(target, attr)
    return target


def parameter_values(module: str, test: str, parameter: str) -> int:
    """How many values ``parameter`` of ``module.test`` is parametrized with."""
    target = _test_function(module, test)
    for mark in getattr(target, "pytestmark", []):
        if mark.name == "parametrize":
            names = mark.args[0]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            if ", ".join(names) == parameter:
                return len(mark.args[1])
    raise AssertionError(f"{module}.{test} is not parametrized by {parameter!r}")


NEW = {
    "manifest": len(cases.MANIFESTS) + 2,  # + the 256 GiB leaf, + any field replaced
    "marker": len(cases.MARKERS),
    "part or session record": len(cases.PART_RECORDS) + 1,
    "profile": len(cases.PROFILES) + 1,  # + any profile text
    "safetensors": len(cases.SAFETENSORS) + 3,  # + an index escaping, any header, sparse
    "step name": len(cases.STEP_NAMES) + 1,  # + any directory name
    "root": len(OPERATIONS) + 3 + 1,  # a file as root; read-only; a symlinked step
}


def test_the_count() -> None:
    """Hostile-input kinds tried: this file's cases plus those other files cover (each
    entry checked against its test's parametrization)."""
    elsewhere: dict[str, int] = {}
    for module, test, kind, count, parameter in cases.ELSEWHERE:
        if parameter is not None:
            found = parameter_values(module, test, parameter)
            assert count in (0, found), f"{module}.{test}: {found} cases, not {count}"
            count = found
        else:
            _test_function(module, test)  # it exists
        elsewhere[kind] = elsewhere.get(kind, 0) + count
    kinds = sorted(set(NEW) | set(elsewhere))
    print(f"\n{'kind':24} {'here':>5} {'elsewhere':>9}")
    for kind in kinds:
        print(f"{kind:24} {NEW.get(kind, 0):>5} {elsewhere.get(kind, 0):>9}")
    total = sum(NEW.values()) + sum(elsewhere.values())
    print(f"{'total':24} {sum(NEW.values()):>5} {sum(elsewhere.values()):>9}  = {total}")
    assert total >= 60
