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
    """

    max_attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 5.0

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

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        cap = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        return (rng or random).uniform(0.0, cap)


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
