"""Codecs: stored bytes, save time and cold restore time of one realistic training state
saved raw, with zstd level 1 and with zstd level 3 (`save(..., codecs=...)`), beside
Orbax 0.12.8's `StandardCheckpointer`, which compresses its arrays with zstd level 3.

The state (``--mib`` of payload in all, sharded over a (4, 2) mesh of 8 CPU devices where
a leaf is large) is what a transformer's training state holds, not random bytes (which no
codec shrinks and which would tell nothing):

- bfloat16 weights drawn from a normal distribution (what trained weights look like to a
  byte-level compressor: little to gain);
- float32 Adam moments: ``mu`` small normal values, ``nu`` their squares (the exponents
  cluster: some gain);
- an embedding table whose last 40% of rows (tokens never seen) are still zero;
- a few hundred small leaves: biases and norms (ones, zeros), step counters.

Every contender saves the same state once per round into a fresh directory; the rounds
rotate which contender goes first (`benchmarks.common.interleave`). After each save its
directory is evicted from the page cache and restored cold, then removed. Reported per
contender: bytes on disk, and the median, min and max of the save and restore times.
Restores are checked bit-exact against the saved state once.

    python benchmarks/codecs.py               # 512 MiB state, 5 rounds
    python benchmarks/codecs.py --quick       # 16 MiB, 2 rounds (smoke test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from benchmarks.common import (
    RESULTS,
    MiB,
    Stats,
    Timer,
    interleave,
    machine_info,
    markdown_table,
    recycle_memory,
    run_async,
    scratch_dir,
    utc_timestamp,
    write_results,
)
from benchmarks.save_restore import evict_tree

PACKAGES = ["ckptstore", "jax", "tensorstore", "orbax-checkpoint", "zstandard"]
#: What ckptstore's contenders pass as ``codecs=``.
CODECS: dict[str, Any] = {"none": None, "zstd:1": "zstd:1", "zstd:3": "zstd:3"}


def _sharded(host: np.ndarray[Any, Any]) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    return jax.block_until_ready(jax.device_put(host, NamedSharding(mesh, P("x", "y"))))


def state(mib: int, seed: int = 0) -> dict[str, Any]:
    """The module docstring's state, about ``mib`` MiB of payload."""
    rng = np.random.default_rng(seed)
    cols = 1024
    # Rows of one unit (``unit * cols`` bytes); the state is 46 units: per layer 4 (bf16
    # weights of 2 units' rows), 8 (mu) and 8 (nu), and 6 for the embedding.
    unit = max(8, mib * MiB // 46 // cols // 8 * 8)
    params: dict[str, Any] = {}
    mu: dict[str, Any] = {}
    nu: dict[str, Any] = {}
    for i in range(2):
        w = rng.standard_normal((2 * unit, cols), dtype=np.float32) * 0.02
        params[f"layer_{i}"] = {"kernel": _sharded(w.astype(ml_dtypes.bfloat16))}
        m = rng.standard_normal((2 * unit, cols), dtype=np.float32) * 1e-3
        mu[f"layer_{i}"], nu[f"layer_{i}"] = _sharded(m), _sharded(m * m)
    embed = rng.standard_normal((6 * unit, cols // 2), dtype=np.float32) * 0.02
    embed[int(embed.shape[0] * 0.6) :] = 0  # tokens never seen: still zero
    params["embed"] = _sharded(embed.astype(ml_dtypes.bfloat16))
    small = {
        f"block_{j}": {
            "bias": np.zeros(cols, np.float32),
            "scale": np.ones(cols, np.float32),
            "count": np.array(1000 + j, np.int64),
        }
        for j in range(max(4, mib // 2))
    }
    return {"params": params, "opt": {"mu": mu, "nu": nu}, "small": small}


def nbytes(tree: Any) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def assert_bit_exact(got: Any, want: Any) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


class Contender:
    """One way of saving the state: its save and restore as functions of a directory, its
    bytes on disk, and the timings `interleave` collects."""

    def __init__(
        self,
        name: str,
        save: Callable[[Path], None],
        restore: Callable[[Path], Any],
        root: Path,
    ) -> None:
        self.name, self.save, self.restore, self.root = name, save, restore, root
        self.stored = 0
        self.restores = Stats()
        self.rounds = 0

    async def save_and_restore(self) -> float:
        """One round: the save (timed and returned), then a cold restore (timed apart)."""
        where = self.root / f"{self.name.replace(':', '-')}-{self.rounds}"
        self.rounds += 1
        recycle_memory(256 * MiB)
        with Timer() as saving:
            self.save(where)
        self.stored = du(where)
        evict_tree(where)
        recycle_memory(256 * MiB)
        with Timer() as restoring:
            restored = self.restore(where)
        del restored
        self.restores.runs.append(restoring.seconds)
        shutil.rmtree(where)
        return saving.seconds


def contenders(tree: Any, root: Path, orbax: bool) -> list[Contender]:
    like = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )
    out = []
    for name, codecs in CODECS.items():

        def save(where: Path, codecs: Any = codecs) -> None:
            ckptstore.save_sync(str(where), tree, step=1, codecs=codecs)

        def restore(where: Path) -> Any:
            return ckptstore.restore_sync(str(where), 1, like=like)

        out.append(Contender(f"ckptstore {name}", save, restore, root))
    if orbax:
        import orbax.checkpoint as ocp

        def orbax_save(where: Path) -> None:
            with ocp.StandardCheckpointer() as ckpt:
                ckpt.save(where, tree)
                ckpt.wait_until_finished()

        def orbax_restore(where: Path) -> Any:
            with ocp.StandardCheckpointer() as ckpt:
                return ckpt.restore(where, like)

        out.append(Contender("orbax (zstd:3)", orbax_save, orbax_restore, root))
    return out


def check_once(tree: Any, root: Path) -> None:
    """Every ckptstore contender restores the state bit-exact (untimed)."""
    for name, codecs in CODECS.items():
        where = root / f"check-{name.replace(':', '-')}"
        ckptstore.save_sync(str(where), tree, step=1, codecs=codecs)
        assert_bit_exact(ckptstore.restore_sync(str(where), 1), tree)
        assert ckptstore.verify_sync(str(where), 1).ok
        shutil.rmtree(where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="payload of the state")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 rounds")
    parser.add_argument("--no-orbax", action="store_true", help="ckptstore's contenders only")
    parser.add_argument("--no-write-results", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "codecs.json")
    args = parser.parse_args()
    mib, rounds = (16, 2) if args.quick else (args.mib, args.rounds)
    tree = state(mib)
    payload = nbytes(tree)
    with scratch_dir("ckptstore-codecs-") as root:
        print(f"scratch directory: {root}")
        check_once(tree, root)
        runners = contenders(tree, root, not args.no_orbax)
        saves = run_async(interleave(rounds, [c.save_and_restore for c in runners]))
    rows, results = [], []
    for c, save in zip(runners, saves, strict=True):
        rows.append(
            [
                c.name,
                f"{c.stored / MiB:.1f} MiB",
                f"{c.stored / payload:.3f}",
                f"{save.median:.3f} s ({save.min:.3f}-{save.max:.3f})",
                f"{c.restores.median:.3f} s ({c.restores.min:.3f}-{c.restores.max:.3f})",
            ]
        )
        results.append(
            {
                "contender": c.name,
                "stored_bytes": c.stored,
                "stored_ratio": round(c.stored / payload, 4),
                "save": save.to_json(payload),
                "restore": c.restores.to_json(payload),
            }
        )
    print(f"state: {payload / MiB:.1f} MiB payload, {len(jax.tree.leaves(tree))} leaves")
    headers = ["contender", "on disk", "of payload", "save", "restore (cold)"]
    print(markdown_table(headers, rows))
    if not args.no_write_results:
        write_results(
            args.out,
            {
                "benchmark": "codecs",
                "when": utc_timestamp(),
                "payload_bytes": payload,
                "rounds": len(saves[0].runs),
                "results": results,
                "machine": machine_info(PACKAGES, root),
            },
        )
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
