"""Retrying transient storage failures with capped exponential backoff and full jitter."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ckptstore.errors import ConfigError, RetriesExhaustedError, TransientStorageError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a `TransientStorageError`.

    ``max_attempts`` counts the first try; 1 disables retries. The wait before
    retry ``n`` (1-based) is uniform in ``[0, min(max_delay, base_delay * 2**(n-1))]``.

    ``deadline``: seconds one operation of the byte API may take in all, from the moment it
    starts (after waiting for a concurrency slot), its retries and their waits included,
    plus ``nbytes / min_rate`` for the bytes it moves; past it the operation fails with
    `RetriesExhaustedError`. None: no deadline. So an endpoint that accepts connections and
    never answers fails a save in about ``deadline`` seconds, not ``max_attempts`` read
    timeouts; a large transfer that keeps moving gets its time.
    """

    max_attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 5.0
    deadline: float | None = 120.0
    min_rate: float = float(1 << 20)  # bytes per second a transfer is allowed at least

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigError(f"retry max_attempts must be an integer >= 1, got {_shown(attempts)}")
        for name in ("base_delay", "max_delay"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 <= value < math.inf
            ):
                raise ConfigError(
                    f"retry {name} must be a finite number of seconds >= 0, got {_shown(value)}"
                )

        if self.deadline is not None and not _positive(self.deadline):
            raise ConfigError(
                f"retry deadline must be a finite number of seconds > 0 (or None), "
                f"got {_shown(self.deadline)}"
            )
        if not _positive(self.min_rate):
            raise ConfigError(
                "retry min_rate must be a finite number of bytes/s > 0, "
                f"got {_shown(self.min_rate)}"
            )

    def limit(self, nbytes: int = 0) -> float | None:
        """Seconds an operation moving ``nbytes`` may take in all (None: no limit)."""
        return None if self.deadline is None else self.deadline + nbytes / self.min_rate

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        cap = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        return (rng or random).uniform(0.0, cap)


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def _shown(value: object) -> str:
    """``value`` and its type, short, for a message (``'many'`` (a str))."""
    return f"{repr(value)[:40]} (a {type(value).__name__})"


NO_RETRY = RetryPolicy(max_attempts=1)


async def retry_async(
    op: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
) -> T:
    """Run ``op(attempt)`` until it succeeds, retrying only `TransientStorageError`.

    Any other exception propagates at once. When the attempts run out the last
    transient error is raised as `RetriesExhaustedError` (itself transient).
    """
    attempt = 1
    while True:
        try:
            return await op(attempt)
        except RetriesExhaustedError:
            raise
        except TransientStorageError as exc:
            if attempt >= policy.max_attempts:
                if policy.max_attempts == 1:
                    raise
                raise RetriesExhaustedError(
                    f"gave up after {attempt} attempts: {exc.message}",
                    backend=exc.backend,
                    key=exc.key,
                ) from exc
            await asyncio.sleep(policy.delay(attempt))
            attempt += 1
