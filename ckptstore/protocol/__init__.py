"""The commit protocol (v3): an attempt, its fate, the marker that commits it, and the checks
a reader makes before it believes any of them.

- `attempt.py`: `Attempt`, one try at saving a step as one actor handles it (claim its fate,
  commit, abandon, clear), and `check_base`, the re-check of an incremental save's base;
- `fates.py`: `Fate`, decided once per attempt by the first actor to claim it;
- `markers.py`: `Marker` and `StepRecords`, a step's commits and revocations, created and
  revoked (`create_marker`, `revoke`);
- `reads.py`: committed steps, their markers and manifests, each checked;
- `recent.py`: the manifests this process committed lately (`RECENT`).

A step is committed when it has a current marker; a marker is created last, once, by the
actor that won the attempt's fate for its commit. docs/architecture.md ("The commit
protocol") argues each rule.
"""

from ckptstore.protocol.attempt import Attempt, check_base
from ckptstore.protocol.fates import ABANDON, COLLECT, COMMIT, Fate, new_owner
from ckptstore.protocol.markers import (
    Marker,
    StepRecords,
    create_marker,
    digest,
    ensure_uncommitted,
    revoke,
    step_records,
)
from ckptstore.protocol.reads import (
    committed_steps,
    is_committed,
    latest_manifest,
    load_committed,
    load_manifest,
    read_marker,
    read_marker_and_bytes,
    read_marker_bytes,
    resolve_step,
    same_commit,
)
from ckptstore.protocol.recent import RECENT, RecentCommits

__all__ = [
    "ABANDON",
    "COLLECT",
    "COMMIT",
    "RECENT",
    "Attempt",
    "Fate",
    "Marker",
    "RecentCommits",
    "StepRecords",
    "check_base",
    "committed_steps",
    "create_marker",
    "digest",
    "ensure_uncommitted",
    "is_committed",
    "latest_manifest",
    "load_committed",
    "load_manifest",
    "new_owner",
    "read_marker",
    "read_marker_and_bytes",
    "read_marker_bytes",
    "resolve_step",
    "revoke",
    "same_commit",
    "step_records",
]
