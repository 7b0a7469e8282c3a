"""Keeping checkpoint bytes out of the page cache while they are written.

A save writes gigabytes that the training job will not read back soon. Left in
the page cache they crowd out the job's own memory, and every new page the
kernel must find for them costs time: on VMs whose free memory is handed back
to the host, a page never touched before is several times slower to fill than
one just released. Dropping each file's pages as soon as they are written back
keeps the cache small and lets the kernel recycle the same (warm) pages for the
rest of the save, which made a 1 GiB save more than twice as fast on the benchmark
VM (docs/benchmarks.md, "The host takes freed memory back").
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType


def drop_pages(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to drop ``path``'s cached pages (clean ones go; dirty ones start
    writing back). Errors are ignored: this is advice, never needed for correctness."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class PageCacheEvictor:
    """While active, a thread drops the pages of files below ``root`` every ``interval``
    seconds; a last pass runs on exit (when the files are durable, all their pages go)."""

    def __init__(self, root: Path, interval: float = 0.02):
        self.root = root
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptstore-evict", daemon=True)
        self._seen: dict[str, int] = {}  # path -> size when its pages were last dropped

    def sweep(self, *, force: bool = False) -> None:
        """One pass; skips files unchanged since their last pass unless ``force``."""
        for directory, _dirs, files in os.walk(self.root):
            for name in files:
                path = os.path.join(directory, name)
                try:
                    size = os.stat(path).st_size
                except OSError:
                    continue
                if force or self._seen.get(path) != size:
                    drop_pages(path)
                    self._seen[path] = size

    def _run(self) -> None:
        pause = self.interval
        while not self._stop.wait(pause):
            start = time.monotonic()
            self.sweep()
            # Many files make a sweep slow: then sweep less often, at most ~10% of a core.
            pause = max(self.interval, 10 * (time.monotonic() - start))

    def __enter__(self) -> PageCacheEvictor:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.sweep(force=True)
