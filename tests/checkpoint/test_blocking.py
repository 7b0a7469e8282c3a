"""The blocking API: a twin for every async entry point, the same kinds of target everywhere,
a clear error for a tree where the step goes, and Ctrl-C that stops the work."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pydoc
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.local import LocalBackend

TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": {"c": np.ones(2)}}


def test_every_async_entry_point_has_a_blocking_twin() -> None:
    coroutines = [
        name for name in ckptstore.__all__ if inspect.iscoroutinefunction(getattr(ckptstore, name))
    ]
    assert {"save", "restore", "partial_save", "read_manifest", "promote"} <= set(coroutines)
    for name in coroutines:
        twin = getattr(ckptstore, f"{name}_sync", None)
        assert twin is not None and f"{name}_sync" in ckptstore.__all__, name
        assert not inspect.iscoroutinefunction(twin) and f"`ckptstore.{name}`" in twin.__doc__


TWINS = [name for name in ckptstore.__all__ if name.endswith("_sync")]


@pytest.mark.parametrize("name", TWINS)
def test_every_twin_has_its_async_functions_signature_and_types(name: str) -> None:
    twin, fn = getattr(ckptstore, name), getattr(ckptstore, name.removesuffix("_sync"))
    mine, theirs = inspect.signature(twin), inspect.signature(fn)
    assert list(mine.parameters) != ["args", "kwargs"], f"{name} has no signature"
    assert mine.parameters == theirs.parameters, name
    hints, async_hints = inspect.get_annotations(twin), dict(inspect.get_annotations(fn))
    if name == "partial_save_sync":  # a session whose methods block
        assert hints["return"] is ckptstore.PartialSaveSync
        async_hints["return"] = ckptstore.PartialSaveSync
    assert hints == async_hints, name
    assert twin.__name__ == name and twin.__module__.startswith("ckptstore.")
    assert getattr(sys.modules[twin.__module__], name) is twin  # found where it says it is
    assert inspect.cleandoc(fn.__doc__) in twin.__doc__  # help() shows the whole story
    assert "(*args, **kwargs)" not in pydoc.render_doc(twin, renderer=pydoc.plaintext)


def test_the_blocking_sessions_methods_have_the_async_ones_signatures() -> None:
    for name in ("add", "drop", "abandon", "finalize", "close"):
        mine = inspect.signature(getattr(ckptstore.PartialSaveSync, name))
        theirs = inspect.signature(getattr(ckptstore.PartialSave, name))
        assert mine.parameters == theirs.parameters, name
        assert mine.return_annotation == theirs.return_annotation, name


def test_partial_save_sync(tmp_path: Path) -> None:
    with ckptstore.partial_save_sync(tmp_path, 5) as session:
        session.add({"w": TREE["w"]})
        session.add({"b": TREE["b"]})
        assert sorted(session.leaves) == ["b/c", "w"] and len(session.parts) == 2
        result = session.finalize()
    assert result.step == 5 and result.attempt == session.attempt
    back = ckptstore.restore_sync(tmp_path, 5)
    np.testing.assert_array_equal(back["w"], TREE["w"])
    np.testing.assert_array_equal(back["b"]["c"], TREE["b"]["c"])
    dropped = ckptstore.partial_save_sync(tmp_path, 6)
    dropped.add({"x": np.zeros(3)})
    dropped.abandon()
    assert ckptstore.list_steps_sync(tmp_path) == [5]


def targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[[], Any]]:
    """Each kind of target, as a function making it (a fresh open backend each call)."""
    root = tmp_path / "plain"
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "plain.toml").write_text(f'url = "{root}"\n')
    tiers = profiles / "tiers.toml"
    tiers.write_text(f'[tiers]\nfast = "{tmp_path}/fast"\ndurable = "{tmp_path}/durable"\n')
    monkeypatch.setenv("CKPTSTORE_PROFILES_DIR", str(profiles))
    monkeypatch.setenv("CKPTSTORE_PROFILE", "plain")
    return {
        "str": lambda: str(root),
        "Path": lambda: root,
        "file URL": lambda: f"file://{root}",
        "Backend": lambda: LocalBackend(root),
        "profile file": lambda: str(profiles / "plain.toml"),
        "None with $CKPTSTORE_PROFILE": lambda: None,
        "Tiered": lambda: ckptstore.Tiered(tmp_path / "fast", tmp_path / "durable"),
        "tiers profile": lambda: tiers,
        "None with $CKPTSTORE_PROFILE of tiers": lambda: None,
    }


KINDS = [
    "str",
    "Path",
    "file URL",
    "Backend",
    "profile file",
    "None with $CKPTSTORE_PROFILE",
    "Tiered",
    "tiers profile",
    "None with $CKPTSTORE_PROFILE of tiers",
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_point_takes_every_kind_of_target(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = targets(tmp_path, monkeypatch)[kind]
    if kind.endswith("of tiers"):
        monkeypatch.setenv("CKPTSTORE_PROFILE", "tiers")
    ckptstore.save_sync(make(), TREE, step=1)
    with ckptstore.partial_save_sync(make(), 2) as session:
        session.add(TREE)
        session.finalize()
    assert ckptstore.list_steps_sync(make()) == [1, 2]
    assert ckptstore.read_manifest_sync(make(), 2).step == 2
    assert ckptstore.verify_sync(make(), 1).ok
    np.testing.assert_array_equal(ckptstore.restore_sync(make(), 1)["w"], TREE["w"])
    assert ckptstore.delete_step_sync(make(), 1).objects > 0
    assert isinstance(ckptstore.gc_sync(make(), older_than=0), ckptstore.Removal)
    assert ckptstore.list_steps_sync(make()) == [2]
    exported = ckptstore.export_orbax_sync(make(), tmp_path / "orbax", step=2)
    assert exported.step == 2 and exported.leaves == 2
    ckptstore.import_orbax_sync(tmp_path / "orbax", make(), as_step=3)
    np.testing.assert_array_equal(ckptstore.restore_sync(make(), 3)["b"]["c"], TREE["b"]["c"])
    if "tiers" in kind or kind == "Tiered":
        assert [p.step for p in ckptstore.promote_sync(make())] == [2, 3]
        assert ckptstore.list_steps_sync(tmp_path / "durable") == [2, 3]
    else:
        with pytest.raises(ckptstore.ConfigError, match="promote needs two tiers"):
            ckptstore.promote_sync(make())
    assert asyncio.run(ckptstore.read_manifest(make())).step == 3  # the async one too


@pytest.mark.parametrize("call", ["restore_sync", "verify_sync", "delete_step_sync", "save"])
def test_a_tree_where_the_step_goes(call: str, tmp_path: Path) -> None:
    big = {f"layer{i}": np.zeros((100, 100)) for i in range(50)}
    ckptstore.save_sync(tmp_path, TREE, step=1)
    with pytest.raises(ckptstore.InvalidStepError) as info:
        if call == "save":
            ckptstore.save_sync(tmp_path, TREE, step=big)
        else:
            getattr(ckptstore, call)(tmp_path, big)
    message = str(info.value)
    assert message.startswith("step must be a non-negative int, got a dict")
    assert "like=" in message and len(message) < 200 and "layer" not in message
    with pytest.raises(ckptstore.InvalidStepError, match=r"got -1$"):
        ckptstore.restore_sync(tmp_path, -1)
    with pytest.raises(ckptstore.InvalidStepError, match=r"got '3'$"):
        ckptstore.restore_sync(tmp_path, "3")


INTERRUPTED_SAVE = """
import json, os, signal, sys, time
import numpy as np
import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.testing.faults import FaultyBackend

root = sys.argv[1]
rng = np.random.default_rng(0)
tree = {f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(12)}  # 48 MiB
signalled = []

def on_sigint(signum, frame):
    signalled.append(time.monotonic())
    raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_sigint)

def files():
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(folder, name))
            out[os.path.join(folder, name)] = [st.st_size, st.st_mtime_ns]
    return out

print("saving", flush=True)
# Each byte-API call (the manifest, the marker) waits 0.5 s: the save is still running when
# SIGINT arrives, however fast the machine writes the data.
slow = FaultyBackend(LocalBackend(root), latency=0.5)
try:
    ckptstore.save_sync(slow, tree, step=3)
    outcome = "completed"
except KeyboardInterrupt:
    outcome = "interrupted"
unwound = time.monotonic()
before = files()
time.sleep(1.5)
after = files()
report = {
    "outcome": outcome,
    "unwind_seconds": unwound - signalled[0] if signalled else None,
    "files": len(before),
    "changed_after": sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)),
    "steps_after": ckptstore.list_steps_sync(root),
}
ckptstore.save_sync(root, tree, step=3)  # the same step again, from scratch
back = ckptstore.restore_sync(root, 3)
report["resaved"] = ckptstore.list_steps_sync(root)
report["restored_equal"] = all(np.array_equal(back[k], v) for k, v in tree.items())
print(json.dumps(report), flush=True)
"""


def test_ctrl_c_in_a_blocking_save_stops_it(tmp_path: Path) -> None:
    """SIGINT while save_sync writes 48 MiB: KeyboardInterrupt once the work has stopped,
    nothing committed, nothing written afterwards, and the same step saves again."""
    root = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_SAVE, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + 120
    while not (root / "3").is_dir() or not any(p.is_file() for p in (root / "3").rglob("*")):
        assert time.monotonic() < deadline and child.poll() is None, "the save never started"
        time.sleep(0.002)
    child.send_signal(signal.SIGINT)  # the save has begun writing step 3
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["outcome"] == "interrupted", "the save finished before SIGINT arrived"
    assert report["files"] > 0  # it had written something of step 3
    assert report["changed_after"] == []  # nothing kept writing after KeyboardInterrupt
    assert report["steps_after"] == []  # not committed
    assert report["resaved"] == [3] and report["restored_equal"]
    print(f"unwound {report['unwind_seconds']:.2f} s after SIGINT")


def test_numpy_and_jax_integer_steps(tmp_path: Path) -> None:
    """A train state's step is often a NumPy or 0-d JAX integer: it names the same step
    as the Python int everywhere, and what is stored is a plain JSON integer."""
    import jax.numpy as jnp

    ckptstore.save_sync(tmp_path, TREE, step=np.int64(3))
    ckptstore.save_sync(tmp_path, TREE, step=jnp.asarray(5, jnp.int32))
    with ckptstore.partial_save_sync(tmp_path, np.uint16(7)) as part:
        part.add(TREE)
        assert part.finalize().step == 7
    assert ckptstore.list_steps_sync(tmp_path) == [3, 5, 7]
    manifest = asyncio.run(ckptstore.read_manifest(tmp_path, np.int32(5)))
    assert manifest.step == 5 and type(manifest.step) is int
    restored = ckptstore.restore_sync(tmp_path, jnp.asarray(3))
    np.testing.assert_array_equal(restored["w"], TREE["w"])
    assert ckptstore.verify_sync(tmp_path, np.int8(7)).ok
    ckptstore.delete_step_sync(tmp_path, np.int64(3))
    assert ckptstore.list_steps_sync(tmp_path) == [5, 7]
    with ckptstore.CheckpointManager(tmp_path / "mgr") as mgr:
        handle = mgr.save(jnp.asarray(11), TREE, force=True)
        assert handle is not None
        handle.wait()
        assert mgr.all_steps() == [11] and type(mgr.latest_step()) is int
    for bad in (np.float64(3.0), np.bool_(True), jnp.asarray([1, 2]), np.int64(-1)):
        with pytest.raises(ckptstore.InvalidStepError):
            ckptstore.save_sync(tmp_path, TREE, step=bad)
