"""The memory budget a read must fit before its buffer is sized.

TensorStore sizes a read's output buffer from the array's declared shape, in C++: when the
allocation fails (``std::bad_alloc``) the process aborts, with no Python exception to catch.
So a read larger than this process could ever map is refused first, typed
(`InsufficientMemoryError`): larger than what its address-space limit (``RLIMIT_AS``) leaves,
or than the machine's memory and swap together (what Linux's overcommit heuristic refuses).
Reads below `CHECK_ABOVE` are not checked: they cannot be the problem, and the check
reads ``/proc``.
"""

from __future__ import annotations

import os
import resource

from ckptstore.errors import InsufficientMemoryError

#: Reads of at most this many bytes pass unchecked.
CHECK_ABOVE = 256 << 20


def available_bytes() -> int | None:
    """Bytes this process could still map, or None where that is not known."""
    limits: list[int] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(0, soft - _mapped_bytes()))
    total = _meminfo_bytes("MemTotal") + _meminfo_bytes("SwapTotal")
    if total:
        limits.append(total)
    return min(limits) if limits else None


def check_fits(nbytes: int, what: str, *, leaf: str | None = None) -> None:
    """Raise `InsufficientMemoryError` if a ``nbytes`` buffer cannot be mapped."""
    if nbytes <= CHECK_ABOVE:
        return
    available = available_bytes()
    if available is not None and nbytes > available:
        raise InsufficientMemoryError(
            f"{what} needs a {nbytes}-byte buffer; this process can map {available} more "
            "bytes at most (read onto a sharding with like= to read slices)",
            needed=nbytes,
            available=available,
            leaf=leaf,
        )


def _mapped_bytes() -> int:
    """The process's address space in use (``/proc/self/statm``'s first field)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _meminfo_bytes(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
