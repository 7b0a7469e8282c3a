"""The plots of docs/benchmarks.md, drawn from the recorded results: no benchmark runs.

Every benchmark writes its raw timings to ``benchmarks/results/<name>.json``; this script
reads those files and draws one figure per comparison into ``docs/img/`` (``make bench``
runs it last). In each comparison figure a bar is a contender's median, the whiskers its
fastest and slowest repetition, and the text beside a pair is the ratio the benchmark
reports, with its floor and verdict where it has one.

    python benchmarks/report.py                       # benchmarks/results -> docs/img
    python benchmarks/report.py --out /tmp/plots      # somewhere else
    python benchmarks/report.py --only storage.png    # one figure
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
IMG = REPO / "docs" / "img"
OURS, PEER = "tab:blue", "tab:orange"
MiB = 1 << 20
NOTE: dict[str, Any] = {"textcoords": "offset points", "va": "center", "fontsize": 8}


class MissingResults(Exception):
    """A figure's results file is absent: run its benchmark first."""


@dataclass(frozen=True)
class Stat:
    """A contender's median and its fastest / slowest repetition (seconds, or GB/s)."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, timing: dict[str, Any]) -> Stat:
        """From a results entry with ``median_s``, ``min_s`` and ``max_s``."""
        return cls(timing["median_s"], timing["min_s"], timing["max_s"])

    @classmethod
    def runs(cls, values: Sequence[float]) -> Stat:
        """From the raw repetitions."""
        return cls(statistics.median(values), min(values), max(values))

    @classmethod
    def gbps(cls, timing: dict[str, Any]) -> Stat:
        """Throughput: median, worst and best GB/s."""
        return cls(timing["median_gbps"], timing["worst_gbps"], timing["best_gbps"])


@dataclass(frozen=True)
class Row:
    """One comparison: ckptstore against one peer, with the ratio the benchmark reports."""

    label: str
    ours: Stat
    peer: Stat
    ratio: float
    note: str = ""  # floor and verdict, or what the ratio is against


def load(results: Path, name: str) -> dict[str, Any]:
    """``results/<name>``, parsed."""
    path = results / name
    if not path.is_file():
        raise MissingResults(f"{path} is missing (run benchmarks/{name.split('_')[0]}*.py)")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def newest_part(results: Path, prefix: str, part: str) -> dict[str, Any]:
    """The most recent ``<prefix>*.json`` run whose results include ``part`` (by timestamp).

    The object-read benchmark can run its parts separately (``--parts``, ``--output``), so
    the current figures of each part may come from different files.
    """
    runs = [json.loads(p.read_text()) for p in sorted(results.glob(f"{prefix}*.json"))]
    runs = [r for r in runs if any(v.get(part) for v in r["results"].values())]
    if not runs:
        raise MissingResults(f"no {results}/{prefix}*.json holds the '{part}' part")
    return max(runs, key=lambda r: r["timestamp"])


def verdict_note(floor: Any, ok: Any) -> str:
    """``floor >= 0.9x PASS`` from a floor (a number or its text) and a pass flag."""
    if floor in (None, "-"):
        return ""
    text = floor if isinstance(floor, str) else f">= {floor}x"
    word = {True: "PASS", False: "FAIL", "PASS": "PASS", "FAIL": "FAIL"}.get(ok, "")
    return f"floor {text} {word}".rstrip()


def ratio_text(ratio: float, note: str) -> str:
    """``0.96x``; with more digits where two would round a failed ratio onto its floor."""
    text = f"{ratio:.2f}x"
    floor = re.search(r"floor [<>]= ([0-9.]+)x", note)
    if floor and "FAIL" in note and text == f"{float(floor.group(1)):.2f}x":
        text = f"{ratio:.4f}x"
    return text


def table_rows(table: str) -> list[list[str]]:
    """The cells of a Markdown table a benchmark stored as text (header and rule dropped)."""
    lines = [ln for ln in table.splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def pairs(ax: Axes, rows: Sequence[Row], *, peer: str, unit: str, log: bool = False) -> None:
    """Horizontal bars: ckptstore above its peer for each row, whiskers fastest to slowest."""
    y = np.arange(len(rows))[::-1] * 3.0
    for offset, color, name, stats in (
        (0.5, OURS, "ckptstore", [r.ours for r in rows]),
        (-0.5, PEER, peer, [r.peer for r in rows]),
    ):
        err = [[s.median - s.lo for s in stats], [s.hi - s.median for s in stats]]
        med = [s.median for s in stats]
        ax.barh(y + offset, med, height=0.9, color=color, label=name, xerr=np.abs(err))
    top = max(max(r.ours.hi, r.peer.hi) for r in rows)
    for yi, r in zip(y, rows, strict=True):
        text = f"{ratio_text(r.ratio, r.note)}  {r.note}".rstrip()
        ax.annotate(text, (max(r.ours.hi, r.peer.hi), yi), (6, 0), **NOTE)
    ax.set_yticks(y, [r.label for r in rows], fontsize=8)
    ax.set_ylim(-1.5, y[0] + 3.2)  # a free band at the top for the legend
    ax.set_xlabel(unit)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(right=top * 8)
    else:
        ax.set_xlim(0, top * 1.6)
    ax.grid(True, axis="x", alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right", ncol=2)


def figure(rows: int, cols: int = 1, *, height: float, width: float = 10) -> tuple[Figure, Any]:
    """A figure of ``rows`` x ``cols`` axes."""
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    return fig, axes


def single(rows: Sequence[Row], title: str, *, peer: str, unit: str, log: bool = False) -> Figure:
    """A figure of one `pairs` chart, as tall as its rows need."""
    fig, ax = figure(1, height=0.75 * len(rows) + 1.6)
    pairs(ax[0, 0], rows, peer=peer, unit=unit, log=log)
    ax[0, 0].set_title(title)
    return fig


# ---- one function per figure --------------------------------------------------------------


def storage(results: Path) -> Figure:
    """Each backend's large-object write and read against its raw client (GB/s)."""
    data = load(results, "storage.json")
    rows = []
    for r in data["results"]:
        for b in r["baselines"]:
            label = f"{r['backend']} {r['op']} ({r['bytes'] // MiB} MiB)\nvs {b['name']}"
            note = verdict_note(b["floor"], b["verdict"]) or "info"
            rows.append(Row(label, Stat.gbps(r["ckptstore"]), Stat.gbps(b), b["ratio"], note))
    title = "Storage layer: each backend against its raw client"
    return single(rows, title, peer="raw client / dd", unit="GB/s (log scale)", log=True)


def object_reads(results: Path) -> Figure:
    """Ranged GETs against one GET; TensorStore's settings against its defaults."""
    reads = newest_part(results, "object_reads", "reads")
    ts = newest_part(results, "object_reads", "tensorstore")
    fig, axes = figure(1, 3, height=6, width=16)
    for ax, title, part, run, key in (
        (axes[0, 0], f"reads of {reads['config']['size_mib']} MiB", "reads", reads, None),
        (axes[0, 1], f"save of a {ts['config']['tree_mib']} MiB tree", "tensorstore", ts, "save"),
        (axes[0, 2], "restore of that tree", "tensorstore", ts, "restore"),
    ):
        labels, stats, ratios = [], [], []
        for server, parts in run["results"].items():
            entries = parts[part]
            base = Stat.gbps(entries[0] if key is None else entries[0][key])
            for e in entries:
                s = Stat.gbps(e if key is None else e[key])
                labels.append(f"{'moto' if server == 's3' else 'fake-gcs'}: {e['setting']}")
                stats.append(s)
                ratios.append(s.median / base.median)
        y = np.arange(len(stats))[::-1]
        med = np.array([s.median for s in stats])
        err = np.abs([[s.median - s.lo for s in stats], [s.hi - s.median for s in stats]])
        colors = [
            PEER if i == 0 or labels[i].split(":")[0] != labels[i - 1].split(":")[0] else OURS
            for i in range(len(labels))
        ]
        ax.barh(y, med, color=colors, xerr=err)
        for yi, s, q in zip(y, stats, ratios, strict=True):
            ax.annotate(
                f"{q:.2f}x", (s.hi, yi), (4, 0), textcoords="offset points", va="center", fontsize=8
            )
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xlim(0, max(s.hi for s in stats) * 1.3)
        ax.set(xlabel="GB/s", title=title)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(
        "Object stores on local emulators (orange: the reference each ratio is "
        "against: one GET, TensorStore's defaults)"
    )
    return fig


def partial_bytes(results: Path) -> Figure:
    """Cumulative bytes written vs k (left, GiB) and bytes / payload so far (right, log y)."""
    data = load(results, "partial.json")
    runs, fig_data, config = data["runs"], data["figures"], data["config"]
    orbax = data["machine"]["packages"].get("orbax-checkpoint", "")
    payload = np.asarray(runs["ckptstore"][0]["payload"], float)
    k = np.arange(1, len(payload) + 1)
    snapshot = fig_data["snapshot_copy_analytic_curve"]
    lines = [
        ("snapshot-copy (from ckptstore's part sizes)", snapshot, "tab:red", "-"),
        (f"Orbax {orbax} (write_bytes)", runs["orbax"][0]["curve"], "tab:green", "-."),
        ("ckptstore (write_bytes)", runs["ckptstore"][0]["curve"], "tab:blue", "-"),
    ]
    fig, axes = figure(1, 2, height=4.8, width=12)
    left, right = axes[0]
    left.plot(k, payload / 2**30, color="gray", ls="--", lw=1.5, label="payload")
    for label, ys, color, ls in lines:
        left.plot(k, np.asarray(ys) / 2**30, color=color, ls=ls, lw=2, label=label)
        right.plot(k, np.asarray(ys) / payload, color=color, ls=ls, lw=2, label=label)
    for ys, color in [(snapshot, "tab:red"), (runs["ckptstore"][0]["curve"], "tab:blue")]:
        end = (k[-1], ys[-1] / 2**30)
        style = {"textcoords": "offset points", "ha": "right", "color": color}
        left.annotate(f"{end[1]:.2f} GiB", end, (-4, 6), **style)
    part_mib = config["snapshot_part_mib"]
    points = [
        ("snapshot", "o", "tab:red", f"snapshot-copy, real run ({part_mib} MiB parts)"),
        ("s3", "s", "tab:purple", "ckptstore on S3 (moto), object bytes"),
    ]
    for name, marker, color, label in points:
        ys = np.asarray(runs[name]["curve"]) / np.asarray(runs[name]["payload"])
        right.plot(
            np.arange(1, len(ys) + 1), ys, marker, ms=4, color=color, mfc="none", label=label
        )
    floor = config["floors"]["bytes_max"]
    right.axhline(floor, color="black", lw=0.8, ls=":", label=f"floor {floor}x")
    left.set_ylim(top=max(snapshot) / 2**30 * 1.1)
    title = f"Local disk: K={len(k)} parts, {payload[-1] / 2**30:.2f} GiB float32"
    left.set(xlabel="partial saves k", ylabel="cumulative bytes written (GiB)", title=title)
    right.set(xlabel="partial saves k", ylabel="bytes written / payload so far", yscale="log")
    right.set_title("Write amplification (log scale)")
    right.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    right.yaxis.set_minor_formatter(ticker.NullFormatter())
    for ax in (left, right):
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
    return fig


def partial_orbax(results: Path) -> Figure:
    """K partial saves + finalize: ckptstore against Orbax's partial save."""
    data = load(results, "partial.json")
    timing = data["timing"][0]
    rows = [
        Row(
            f"{timing['op']}\nvs {b['name']}",
            Stat.of(timing["ckptstore"]),
            Stat.of(b),
            b["ratio"],
            verdict_note(b["floor"], b["verdict"]) or "info",
        )
        for b in timing["baselines"]
    ]
    title = f"Partial saves: {timing['bytes'] / 2**30:.2f} GiB in {data['config']['parts']} parts"
    return single(rows, title, peer="Orbax partial save", unit="seconds")


# save_restore.json: (label, ckptstore's timing, the peer's, the comparison's name) per tree
DISK_ROWS = [
    (
        "save\nvs dd oflag=direct conv=fsync",
        "disk:ckpt_save",
        "disk:dd_direct",
        "save (fsync) vs dd",
    ),
    (
        "cold restore\nvs dd of one file",
        "cold:ckpt_restore",
        "cold:raw_read",
        "restore (cold) vs raw read",
    ),
    (
        "cold restore\nvs reading its files",
        "cold:ckpt_restore",
        "cold:raw_read_files",
        "restore (cold) vs reading its files",
    ),
]
ORBAX_ROWS = [
    (
        "save\nvs Orbax + fsync",
        "orbax:ckpt_save",
        "orbax:orbax_save_fsync",
        "save (fsync) vs Orbax + fsync",
    ),
    (
        "cold restore",
        "cold_orbax:ckpt_restore",
        "cold_orbax:orbax_restore",
        "restore (cold) vs Orbax",
    ),
    (
        "warm restore",
        "warm:ckpt_restore_warm",
        "warm:orbax_restore_warm",
        "restore (warm) vs Orbax",
    ),
]


def _save_restore_rows(
    data: dict[str, Any], spec: Sequence[tuple[str, str, str, str]]
) -> list[Row]:
    """Rows ``(what, ours, peer, comparison name)`` for every tree, ratios and floors as
    the benchmark recorded them."""
    named = {c["name"]: c for c in data["comparisons"]}
    rows = []
    for tree, t in data["trees"].items():
        for what, ours, peer, cname in spec:
            if ours not in t["timings"] or peer not in t["timings"]:
                continue
            c = next(v for k, v in named.items() if k.startswith(f"{tree}: {cname}"))
            leaves = t["phase_sizes"][ours.split(":")[0]]["leaves"]
            label = f"{tree} ({leaves:,} leaves): {what}"
            ours_s, peer_s = Stat.of(t["timings"][ours]), Stat.of(t["timings"][peer])
            note = verdict_note(c["floor"], c["pass"])
            rows.append(Row(label, ours_s, peer_s, c["ratio"], note))
    return rows


def save_restore_disk(results: Path) -> Figure:
    """Saves against ``dd oflag=direct``, cold restores against reading the same bytes."""
    data = load(results, "save_restore.json")
    rows = _save_restore_rows(data, DISK_ROWS)
    title = "Save and restore against the disk (1 GiB-class trees, local ext4)"
    return single(rows, title, peer="disk (dd / raw read)", unit="seconds")


def save_restore_orbax(results: Path) -> Figure:
    """Saves, cold and warm restores and a fresh process's restore against Orbax; memory."""
    data = load(results, "save_restore.json")
    rows = _save_restore_rows(data, ORBAX_ROWS)
    named = {c["name"]: c for c in data["comparisons"]}
    mem = data["memory_peak_added_bytes"]
    fresh = named["first restore of a fresh process (cold) vs Orbax"]
    rows.append(
        Row(
            "a: first restore\nof a fresh process",
            Stat.runs([r["seconds"] for r in mem["ckptstore-restore"]]),
            Stat.runs([r["seconds"] for r in mem["orbax-restore"]]),
            fresh["ratio"],
            verdict_note(fresh["floor"], fresh["pass"]),
        )
    )
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 0.75 * (len(rows) + 2) + 2), height_ratios=[len(rows), 2]
    )
    pairs(top, rows, peer="Orbax StandardCheckpointer", unit="seconds")
    top.set_title("Save and restore against Orbax (tree c's Orbax phases at 1/5 size)")

    def over(runs: list[dict[str, Any]], restore: bool) -> Stat:
        added = [(r["peak_added"] - (r["restored_bytes"] if restore else 0)) / MiB for r in runs]
        return Stat.runs(added)

    save_mem = named["peak memory added by a save"]
    rest_mem = named["restore memory over budget + largest shard"]
    mrows = [
        Row(
            "a: peak memory a save adds",
            over(mem["ckptstore"], False),
            over(mem["orbax"], False),
            save_mem["ratio"],
            "of the state; " + verdict_note(save_mem["floor"], save_mem["pass"]),
        ),
        Row(
            "a: a restore's peak over the state",
            over(mem["ckptstore-restore"], True),
            over(mem["orbax-restore"], True),
            rest_mem["ratio"],
            "of budget + largest shard; " + verdict_note(rest_mem["floor"], rest_mem["pass"]),
        ),
    ]
    pairs(bottom, mrows, peer="Orbax", unit="MiB (fresh processes)")
    return fig


def small_leaves(results: Path) -> Figure:
    """Tree c's 5,000 small leaves written durably: packs and raw OCDBT keys against dd."""
    data = load(results, "small_leaves.json")
    r = data["results"]
    dd = Stat.of(r["dd_direct"])
    rows = [
        Row(
            f"{name}\nvs dd oflag=direct conv=fsync",
            Stat.of(r[key]),
            dd,
            data["dd_over"][key],
            note,
        )
        for name, key, note in (
            ("packs (the save's path)", "packs", ""),
            ("one OCDBT key per leaf", "ocdbt_keys", "(the path packs replaced)"),
        )
    ]
    title = f"{data['leaves']:,} small leaves, {data['bytes'] / 1e9:.2f} GB, written durably"
    return single(rows, title, peer="dd", unit="seconds")


FINISHED = "save to finished (old step deleted)"


def training_loop(results: Path) -> Figure:
    """CheckpointManager against Orbax's async CheckpointManager, on one training loop."""
    data = load(results, "training_loop.json")
    runs = data["runs_s"]
    table = {(r[0], r[2]): r for r in table_rows(data["table"])}

    def row(label: str, key: str, who: str, measure: str, baseline: str, scale: float) -> Row:
        """``baseline`` names the table's column; "Orbax uncompressed..." is Orbax with its
        compression off, any other Orbax its default (zstd level 1)."""
        t = table[(measure, baseline)]
        ratio = float(t[4].rstrip("x"))
        them = "orbax-nocomp" if baseline.startswith("Orbax uncompressed") else "orbax"
        ours, peer = (Stat.runs([v * scale for v in runs[w][key]]) for w in (who, them))
        label += ", vs Orbax off" if them == "orbax-nocomp" else ""
        return Row(label, ours, peer, ratio, verdict_note(t[5], t[6]) or "info")

    has_off = "orbax-nocomp" in runs  # results before the uncompressed contender lack it
    durable = [
        ("save to durable (views)", "ckptstore", "save to durable"),
        ("save to durable (host staging)", "ckptstore-host", "host-staging durable"),
        ("save to finished, old step deleted", "ckptstore", FINISHED),
    ]
    rows = []
    for label, who, measure in durable:
        key = "finished" if measure == FINISHED else "durable"
        rows.append(row(label, key, who, measure, "Orbax", 1))
        if has_off:
            rows.append(row(label, key, who, measure, "Orbax uncompressed", 1))
    pause = [
        row("pause per save (views)", "pause", "ckptstore", "pause per save", "Orbax pause", 1e3)
    ]
    if has_off:
        pause.append(
            row(
                "pause per save (views)",
                "pause",
                "ckptstore",
                "pause per save",
                "Orbax uncompressed pause",
                1e3,
            )
        )
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.8), height_ratios=[1, 3])
    peer = "Orbax CheckpointManager (async): default (zstd 1), or compression off (vs Orbax off)"
    pairs(top, pause, peer=peer, unit="milliseconds")
    pairs(bottom, rows, peer=peer, unit="seconds")
    top.set_title(
        f"Training loop, {data['state_bytes'] / 2**30:.0f} GiB state: "
        "ratios are ckptstore / Orbax (lower is better)"
    )
    return fig


def tiered(results: Path) -> Figure:
    """A tiered save's return against a local-only save; promotion against s3fs."""
    data = load(results, "tiered.json")
    runs = data["runs_s"]
    table = {r[0]: r for r in table_rows(data["table"])}

    def note(measure: str) -> str:
        return verdict_note(table[measure][5], table[measure][6]) or "info"

    rows = [
        Row(
            "save return, Tiered(local, S3)\nvs a local-only save",
            Stat.runs(runs["tiered"]),
            Stat.runs(runs["local"]),
            float(table["save return (tiered)"][4].rstrip("x")),
            "tiered / local; " + note("save return (tiered)"),
        ),
        Row(
            "promotion to S3 (moto)\nvs s3fs put",
            Stat.runs(runs["promote"]),
            Stat.runs(runs["s3fs"]),
            float(table["promotion"][4].rstrip("x")),
            "s3fs / promotion; " + note("promotion"),
        ),
    ]
    title = f"Tiered: {data['tree_bytes'] / MiB:.0f} MiB saved to local disk, promoted to S3"
    return single(rows, title, peer="local-only save / s3fs", unit="seconds")


def scale(results: Path) -> Figure:
    """The scale benchmark's own figure (`benchmarks/scale.py`), from its results."""
    import scale as scale_benchmark  # benchmarks/ is on the path of a script run from it

    figure: Figure = scale_benchmark.figure_of(load(results, "scale.json")["runs"])
    return figure


def incremental_chunks(results: Path) -> Figure:
    """The chunk-level incremental benchmark's figure, from its four runs."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # the benchmark imports ckptstore and benchmarks.common
        sys.path.insert(0, root)
    from benchmarks import incremental_chunks as chunks_benchmark

    names = {
        "local disk, run 1": "incremental_chunks.json",
        "local disk, run 2": "incremental_chunks_repeat.json",
        "moto S3, run 1": "incremental_chunks_s3.json",
        "moto S3, run 2": "incremental_chunks_s3_repeat.json",
    }
    figure: Figure = chunks_benchmark.figure_of({k: load(results, v) for k, v in names.items()})
    return figure


PLOTS: dict[str, Callable[[Path], Figure]] = {
    "storage.png": storage,
    "object_reads.png": object_reads,
    "partial_bytes.png": partial_bytes,
    "partial_orbax.png": partial_orbax,
    "save_restore_disk.png": save_restore_disk,
    "save_restore_orbax.png": save_restore_orbax,
    "small_leaves.png": small_leaves,
    "training_loop.png": training_loop,
    "tiered.png": tiered,
    "scale.png": scale,
    "incremental_chunks.png": incremental_chunks,
}


def render(names: Sequence[str], results: Path = RESULTS, out: Path = IMG) -> list[Path]:
    """Draw the figures ``names`` (keys of `PLOTS`) from ``results`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        fig = PLOTS[name](results)
        if not fig.get_layout_engine():
            fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="results folder")
    p.add_argument("--out", type=Path, default=IMG, help="where the PNGs go (docs/img)")
    p.add_argument("--only", action="append", choices=sorted(PLOTS), help="just this figure")
    args = p.parse_args(argv)
    try:
        for path in render(args.only or list(PLOTS), args.results, args.out):
            print(path)
    except MissingResults as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
