"""The torture campaign's report: kill points per operation and backend, and what the
checks after each kill found (tests/campaigns/torture.py).

``python -m tests.campaigns.torture_report [RESULTS]`` prints the table of a results file
(default benchmarks/results/torture.json) from its points.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "torture.json"


@dataclass
class Point:
    """One kill point: what was run, where the kill landed, what the checks found."""

    index: int
    op: str
    backend: str
    processes: int
    step: int
    victims: list[int]
    occurrence: int  # which start of the aimed phase (the part index, for "add")
    fraction: float  # of the aimed phase's usual duration, after it starts
    later: float  # the other processes' kill, after the victims', in the same unit
    window: float = 0.0  # the usual duration used (s)
    landed: str = ""  # innermost phase running when the kill came; "after" if done
    committed: bool | None = None  # the killed operation's step, listed afterwards
    lost: list[int] = field(default_factory=list)
    torn: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: Typed errors of the processes killed later, after a victim died (a peer gone).
    survivors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    timing: list[float] = field(default_factory=list)  # prepare, run and kill, check (s)
    kind: str = ""  # the tree saved (tests.campaigns.torture_worker.KINDS)
    base: int | None = None  # an incremental save's base step
    stop: str = ""  # the exact point killed at (tests.campaigns.killpoints.STOPS), if any
    grace: float = 0.0  # a race's gc: its grace period (s)
    #: Attempts committed steps referenced after the kill whose own step had been deleted
    #: (a deleted base's bytes, found still there).
    held: int = 0
    #: Steps whose deletion was killed after its ``DELETED`` record (still listed), whose
    #: deletion the driver then finished.
    finished: list[int] = field(default_factory=list)
    #: A paused save resumed (SIGCONT) after the deletion of its base and a gc, not killed.
    resumed: bool = False

    @property
    def in_op(self) -> bool:
        return self.landed not in ("after", "")


def summary(points: list[Point]) -> dict[str, Any]:
    """Kill points per operation and backend, and what the checks found."""
    rows: dict[str, dict[str, Any]] = {}
    for p in points:
        key = f"{p.op} x{p.processes} {p.backend}"
        row = rows.setdefault(
            key,
            {
                "op": p.op,
                "processes": p.processes,
                "backend": p.backend,
                "kills": 0,
                "landed_after": 0,
                "listed": 0,
                "lost": 0,
                "torn": 0,
                "problems": 0,
                "phases": defaultdict(int),
            },
        )
        if p.in_op:
            row["kills"] += 1
            row["phases"][p.landed] += 1
        else:
            row["landed_after"] += 1
        row["listed"] += bool(p.committed) and p.op != "gc"
        row["lost"] += len(p.lost)
        row["torn"] += len(p.torn)
        row["problems"] += bool(p.problems)
    for row in rows.values():
        row["phases"] = dict(row["phases"])
    total = {
        "kill_points": sum(p.in_op for p in points),
        "landed_after_the_operation": sum(not p.in_op for p in points),
        "committed_lost": sum(len(p.lost) for p in points),
        "committed_torn": sum(len(p.torn) for p in points),
        "points_with_problems": sum(bool(p.problems) for p in points),
        "survivors_failing_typed": sum(len(p.survivors) for p in points),
        "points_with_a_deleted_base_held": sum(p.held > 0 for p in points),
    }
    return {"total": total, "rows": [rows[k] for k in sorted(rows)]}


def table(report: dict[str, Any]) -> str:
    """kills: landed while the operation ran; after: came once it had ended; listed: the
    operation's step was listed afterwards (committed by the save, not yet deleted); lost,
    torn: committed steps missing or not restoring bit-exact; bad: points where another
    check failed; landed in: the innermost phase the kills came in."""
    head = f"{'operation':10} {'procs':>5} {'backend':7} {'kills':>5} {'after':>5} "
    head += f"{'listed':>6} {'lost':>4} {'torn':>4} {'bad':>4}  landed in"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        phases = ", ".join(f"{k} {v}" for k, v in sorted(r["phases"].items()))
        lines.append(
            f"{r['op']:10} {r['processes']:>5} {r['backend']:7} {r['kills']:>5} "
            f"{r['landed_after']:>5} {r['listed']:>6} {r['lost']:>4} {r['torn']:>4} "
            f"{r['problems']:>4}  {phases}"
        )
    t = report["total"]
    lines.append("-" * len(head))
    lines.append(
        f"{t['kill_points']} kill points in an operation ({t['landed_after_the_operation']} "
        f"after it); committed checkpoints lost: {t['committed_lost']}, torn: "
        f"{t['committed_torn']}; points with other problems: {t['points_with_problems']}"
    )
    if t.get("points_with_a_deleted_base_held"):
        lines.append(
            f"points after which a committed step read a deleted base's bytes: "
            f"{t['points_with_a_deleted_base_held']}"
        )
    for name, f in report.get("final", {}).items():
        lines.append(
            f"{name}: every step deleted ({f['deleted']}), then gc: {f['left']} objects left; "
            f"problems: {len(f['problems'])}"
        )
    return "\n".join(lines)


def write(path: Path, report: dict[str, Any], points: list[Point], **extra: Any) -> None:
    """The results file: the report, ``extra`` (command, commit), then one line per point."""
    head = json.dumps({**report, **extra}, indent=1)
    lines = ",\n  ".join(json.dumps(asdict(p), separators=(",", ":")) for p in points)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head[:-2]},\n "points": [\n  {lines}\n ]\n}}\n')


def main(argv: list[str]) -> int:
    doc = json.loads(Path(argv[0] if argv else RESULTS).read_text())
    report = summary([Point(**p) for p in doc["points"]])
    print(table(report))
    print(f"seed {doc['seed']}, {doc['seconds']} s, commit {doc.get('commit', '?')[:12]}")
    print(f"rerun: {doc['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
