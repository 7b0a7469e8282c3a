"""Host memory over a long run (`accelerator.py --parts memory`): does it grow per save?

The peers' most reported complaint is host memory growing with every save. One process, the
LLM-like tree of `benchmarks.accelerator_loop` (``--mib``), a donated step between saves, each
save waited for (`wait_until_finished`), ``--long-saves`` saves with ckptstore's manager
(``staging="auto"``, `KeepLatest(1)`), then as many with Orbax's async `CheckpointManager`
(``max_to_keep=1``). After each save, the process's resident memory (``/proc/self/statm``).
Reported per library: the RSS added over the run and its slope per save (a least-squares
line through the last three quarters of the saves: the first quarter holds one-time costs,
compiled programs and reused buffers). Floor: <= 1 MiB per save.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.accelerator_loop import make_step, make_tree, orbax, ours, tree_bytes

MiB = 1 << 20
#: Added RSS per save, at most (MiB).
FLOOR_MIB_PER_SAVE = 1.0


def rss() -> int:
    from benchmarks.accelerator import rss as current

    return current()


def one_library(who: str, tree: Any, root: Path, dry: bool, saves: int) -> tuple[Any, list[int]]:
    """``saves`` saves by ``who``, each waited for; the RSS after each."""
    import orbax.checkpoint as ocp

    step_fn, weight = make_step(dry)
    mgr = ours(root / who, 1) if who == "ckptstore" else orbax(root / who, 1)
    after: list[int] = []
    try:
        for step in range(1, saves + 1):
            tree = jax.block_until_ready(step_fn(tree, weight))
            if who == "ckptstore":
                mgr.save(step, tree)
            else:
                mgr.save(step, args=ocp.args.StandardSave(tree))
            mgr.wait_until_finished()
            after.append(rss())
            if step % max(1, saves // 10) == 0:
                print(
                    f"[{time.strftime('%H:%M:%S')}] {who}: save {step}, RSS "
                    f"{after[-1] / (1 << 30):.3f} GiB",
                    flush=True,
                )
    finally:
        mgr.close()
    return tree, after


def slope_per_save(after: list[int]) -> float:
    """Bytes per save of a least-squares line through the last three quarters."""
    tail = after[len(after) // 4 :]
    if len(tail) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(tail)), np.asarray(tail, np.float64), 1)[0])


def memory_part(root: Path, dry: bool, mib: int, saves: int) -> dict[str, Any]:
    """Both libraries, one after the other, on one tree."""
    tree = make_tree("llm", mib)
    out: dict[str, Any] = {"tree": "llm", "bytes": tree_bytes(tree), "saves": saves}
    for who in ("ckptstore", "orbax"):
        start = rss()
        tree, after = one_library(who, tree, root, dry, saves)
        out[who] = {
            "rss_start": start,
            "rss_after_each": after,
            "added_gib": round((after[-1] - start) / (1 << 30), 4),
            "slope_mib_per_save": round(slope_per_save(after) / MiB, 4),
        }
    return out


def memory_table(part: dict[str, Any], judge: bool) -> str:
    from benchmarks import common

    rows = []
    for who in ("ckptstore", "orbax"):
        got = part[who]
        verdict = "-"
        if who == "ckptstore" and judge:
            ok = got["slope_mib_per_save"] <= FLOOR_MIB_PER_SAVE
            verdict = f"<= {FLOOR_MIB_PER_SAVE}: {'PASS' if ok else 'FAIL'}"
        rows.append(
            [
                who,
                str(part["saves"]),
                f"{got['added_gib']:.3f}",
                str(got["slope_mib_per_save"]),
                verdict,
            ]
        )
    head = ["who", "saves", "RSS added GiB", "slope MiB/save", "floor"]
    return common.markdown_table(head, rows)
