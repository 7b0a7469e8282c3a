"""A declared-rows save of a table that lives on an accelerator: what its host copies cost.

The table of `benchmarks/incremental_chunks.py` (float32, ``--mib`` MiB: 65536 x 1024 at
256, chunks of 128 KiB) is put on the first device, saved once, then changed in 2% of its
chunks per step. Each step is saved three ways, side by side in an order that rotates,
each from a fresh `jax.device_put` of the table (untimed) into a root of its own:

- ``bands``: ``save(base=previous SaveResult, changed={"t": rows})`` as it is: the declared
  rows' bands are sliced on the device and only they are copied, the changed chunks
  written from those copies (`ckptstore.datapath.regions`, `.declaredwrites`);
- ``whole``: the same save with every piece copied to the host whole first (`np.asarray`,
  what the save did before `regions`): ``regions.on_accelerator`` patched to say no;
- ``full``: a full save of the step.

Beside them, one `np.asarray` of a fresh copy of the table (its device-to-host copy).
Reported: medians and spreads of each; bands / whole and bands / full. On CPU devices the
three coincide but for the full save (nothing is copied); run it where JAX sees an
accelerator (../shared/accelerator/README.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

import ckptstore
from benchmarks.common import REPO, MiB, machine_info
from benchmarks.incremental_chunks import CHUNK, _touch
from ckptstore.datapath import regions

MODES = ("bands", "whole", "full")


def run(mib: int, steps: int, scratch: Path) -> dict[str, Any]:
    rows = max(64, mib * MiB // 4 // 1024 // 64 * 64)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((rows, 1024), dtype=np.float32)
    device = jax.devices()[0]
    roots = {m: str(scratch / m) for m in MODES}
    last = {
        m: ckptstore.save_sync(
            roots[m], {"t": jax.device_put(host, device)}, step=1, chunk_bytes=CHUNK
        )
        for m in MODES
    }
    chunk = ckptstore.read_manifest_sync(roots["full"], 1).items["state"].leaves["t"].chunk_shape
    times: dict[str, list[float]] = {m: [] for m in (*MODES, "device_to_host")}
    real = regions.on_accelerator
    for step in range(2, steps + 2):
        _, touched = _touch(host, rng, chunk)
        order = MODES[step % 3 :] + MODES[: step % 3]
        for mode in (*order, "device_to_host"):
            tree = {"t": jax.device_put(host, device)}
            jax.block_until_ready(tree)
            regions.on_accelerator = (lambda data: False) if mode == "whole" else real
            start = time.perf_counter()
            try:
                if mode == "device_to_host":
                    np.asarray(tree["t"])
                else:
                    declared = None if mode == "full" else {"t": touched}
                    last[mode] = ckptstore.save_sync(
                        roots[mode],
                        tree,
                        step=step,
                        base=None if mode == "full" else last[mode],
                        changed=declared,
                        chunk_bytes=CHUNK,
                    )
            finally:
                regions.on_accelerator = real
            times[mode].append(time.perf_counter() - start)
            del tree
    for m in ("bands", "whole"):
        restored = ckptstore.restore_sync(roots[m], steps + 1)["t"]
        assert np.array_equal(restored, host), f"{m}: the last step does not restore"
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "benchmark": "declared_device",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "machine": machine_info(("ckptstore", "jax", "jaxlib", "tensorstore"), scratch),
        "device": str(device),
        "mib": mib,
        "steps": steps,
        "chunk_shape": list(chunk),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "medians_s": {k: round(v, 4) for k, v in med.items()},
        "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
        "ratios": {
            "bands_vs_whole": round(med["bands"] / med["whole"], 3),
            "bands_vs_full": round(med["bands"] / med["full"], 3),
            "whole_vs_full": round(med["whole"] / med["full"], 3),
        },
        "restored_bit_exact": True,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks/results/declared_device.json"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="declared-device-"))
    try:
        out = run(args.mib, args.steps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("device", "medians_s", "spread_s", "ratios")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
