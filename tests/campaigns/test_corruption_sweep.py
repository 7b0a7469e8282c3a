"""Byte flips, truncations and deletions of every file a restore uses, on local disk.

Each damaged checkpoint must restore bit-exact (the damage was harmless) or fail
with a typed `CkptStoreError` naming the file or leaf, and `verify` must agree:
intact exactly when the restore is bit-exact. Never a silently different tree,
never an untyped error. By default a sample of positions per file is damaged;
``CKPTSTORE_FULL_SWEEP=1`` damages every byte (the figures in the closing note).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore

FULL = os.environ.get("CKPTSTORE_FULL_SWEEP") == "1"
SAMPLES = 12  # positions per file in the default sweep (the first and last bytes included)


def sample_tree() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    return {
        "params": {
            "w": jax.device_put(
                np.arange(256, dtype=np.float32).reshape(16, 16), NamedSharding(mesh, P("x", "y"))
            ),
            "b": np.linspace(-1, 1, 16).astype(np.float16),
        },
        "opt": [np.int64(3), (np.zeros(4, np.uint8), np.array([True, False]))],
        "step": 12,
        "lr": 0.25,
        "done": False,
    }


def same(a: Any, b: Any) -> bool:
    """Same structure, same Python types, same bits."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if str(ta) != str(tb):
        return False
    for x, y in zip(la, lb, strict=True):
        if type(x) is not type(y) and not (isinstance(x, np.ndarray) and isinstance(y, jax.Array)):
            return False
        xa, ya = np.asarray(x), np.asarray(y)
        if xa.dtype != ya.dtype or xa.shape != ya.shape or xa.tobytes() != ya.tobytes():
            return False
    return True


async def restore_outcome(target: str, expected: Any) -> str:
    try:
        restored = await ckptstore.restore(target, step=1)
    except ckptstore.CkptStoreError as exc:
        names_it = getattr(exc, "leaf", None) or any(
            part in str(exc) for part in ("COMMITTED", "manifest", "marker")
        )
        return "detected" if names_it else f"UNNAMED {type(exc).__name__}: {exc}"
    except Exception as exc:
        return f"UNTYPED {type(exc).__name__}: {exc}"
    return "exact" if same(restored, expected) else "WRONG TREE"


async def verify_outcome(target: str) -> str:
    try:
        report = await ckptstore.verify(target, step=1)
    except ckptstore.CheckpointNotFoundError:  # the marker is gone: the step is not committed
        return "detected"
    except ckptstore.CkptStoreError as exc:
        return f"RAISED {type(exc).__name__}: {exc}"
    except Exception as exc:
        return f"UNTYPED {type(exc).__name__}: {exc}"
    return "ok" if report.ok else "detected"


def damages(size: int) -> list[tuple[str, int]]:
    """(kind, position) of every damage to a file of ``size`` bytes."""
    if FULL or size <= SAMPLES:
        positions = list(range(size))
    else:
        positions = sorted({round(i * (size - 1) / (SAMPLES - 1)) for i in range(SAMPLES)})
    out = [("flip", p) for p in positions]
    out += [("truncate", n) for n in sorted({0, size // 2, max(0, size - 1)})]
    return [*out, ("delete", 0)]


def apply(path: Path, original: bytes, kind: str, pos: int) -> None:
    if kind == "delete":
        path.unlink()
    elif kind == "truncate":
        path.write_bytes(original[:pos])
    else:
        data = bytearray(original)
        data[pos] ^= (0x01, 0x80, 0xFF, 0x20)[pos % 4]
        path.write_bytes(bytes(data))


async def sweep(root: Path, expected: Any) -> tuple[Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    failures: list[str] = []
    files = sorted(p for p in (root / "1").rglob("*") if p.is_file())
    for path in files:
        original = path.read_bytes()
        rel = path.relative_to(root)
        for kind, pos in damages(len(original)):
            apply(path, original, kind, pos)
            try:
                restored = await restore_outcome(str(root), expected)
                verified = await verify_outcome(str(root))
            finally:
                path.write_bytes(original)
            counts[f"restore {restored}"] += 1
            counts[f"verify {verified}"] += 1
            agree = (restored, verified) in (("exact", "ok"), ("detected", "detected"))
            if not agree:
                failures.append(f"{rel} {kind}@{pos}: restore {restored}; verify {verified}")
    return counts, failures


@pytest.mark.parametrize("how", ["save", "partial"])
async def test_every_damage_is_harmless_or_detected_by_both(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ckpt"
    tree = sample_tree()
    if how == "save":
        await ckptstore.save(str(root), tree, step=1)
    else:
        session = await ckptstore.partial_save(str(root), step=1)
        await session.add({"params": tree["params"]})
        await session.add({k: v for k, v in tree.items() if k != "params"})
        await session.finalize()
    counts, failures = await sweep(root, tree)
    cases = counts["restore exact"] + counts["restore detected"]
    print(f"\n{how}: {sum(counts.values()) // 2} damaged checkpoints: {dict(counts)}")
    assert not failures, "\n".join(failures[:30])
    assert counts["restore detected"] > 0 and cases == sum(counts.values()) // 2
