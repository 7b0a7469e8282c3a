"""The manifests this process committed lately, kept so that the next incremental save reads
its base without reading and parsing it again.
"""

from __future__ import annotations

import collections
import threading

from ckptstore.format.manifest import Manifest


class RecentCommits:
    """The last few manifests this process committed, by step, attempt and digest.

    While a step's marker names the attempt and the digest of the manifest kept here, the
    stored manifest is this one (the marker's digest is checked on every read; a manifest
    rewritten since, with a marker signed again, has another digest), on whichever backend
    or tier it was copied to. The next incremental save's base is nearly always the step
    saved last: this spares it a read and a parse of a manifest that records every chunk's
    digest (docs/benchmarks.md). Several are kept, so that saves into a few roots by one
    process (several managers, a benchmark's side-by-side saves) each find their own:
    at most ``size`` of them, and of at most ``budget`` encoded bytes in all (the last one
    always, whatever its size).
    """

    def __init__(self, size: int = 8, budget: int = 32 << 20) -> None:
        self.size, self.budget = size, budget
        self._kept: collections.OrderedDict[tuple[int, str, str], tuple[Manifest, int]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # managers save on threads of their own

    def add(self, manifest: Manifest, manifest_digest: str, nbytes: int = 0) -> None:
        """Keep ``manifest`` (``nbytes`` encoded), dropping the oldest beyond the limits."""
        if manifest.attempt is None:
            return
        key = (manifest.step, manifest.attempt, manifest_digest)
        with self._lock:
            self._kept[key] = (manifest, nbytes)
            self._kept.move_to_end(key)
            total = sum(n for _, n in self._kept.values())
            while len(self._kept) > self.size or (total > self.budget and len(self._kept) > 1):
                total -= self._kept.popitem(last=False)[1][1]

    def get(self, step: int, attempt: str | None, manifest_digest: str | None) -> Manifest | None:
        if attempt is None or manifest_digest is None:
            return None
        with self._lock:
            found = self._kept.get((step, attempt, manifest_digest))
        return None if found is None else found[0]


#: This process's `RecentCommits` (filled by `commit`).
RECENT = RecentCommits()
