"""The torture campaign's report: kill points per operation and backend, and what the
checks after each kill found (tests/torture.py)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.torture import Point


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
                "committed": 0,
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
        row["committed"] += bool(p.committed) and p.op != "gc"
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
    }
    return {"total": total, "rows": [rows[k] for k in sorted(rows)]}


def table(report: dict[str, Any]) -> str:
    head = f"{'operation':10} {'procs':>5} {'backend':7} {'kills':>5} {'after':>5} "
    head += f"{'commit':>6} {'lost':>4} {'torn':>4} {'bad':>4}  landed in"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        phases = ", ".join(f"{k} {v}" for k, v in sorted(r["phases"].items()))
        lines.append(
            f"{r['op']:10} {r['processes']:>5} {r['backend']:7} {r['kills']:>5} "
            f"{r['landed_after']:>5} {r['committed']:>6} {r['lost']:>4} {r['torn']:>4} "
            f"{r['problems']:>4}  {phases}"
        )
    t = report["total"]
    lines.append("-" * len(head))
    lines.append(
        f"{t['kill_points']} kill points in an operation ({t['landed_after_the_operation']} "
        f"after it); committed checkpoints lost: {t['committed_lost']}, torn: "
        f"{t['committed_torn']}; points with other problems: {t['points_with_problems']}"
    )
    return "\n".join(lines)
