"""Cross-process agreement through jax.distributed's coordination service.

A key-value store whose reads wait with a timeout and fail with a clear error.
Single-process code never calls it (see `ckptstore.runtime.handoff`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import jax

from ckptstore.errors import CoordinationError

DEFAULT_TIMEOUT = 600.0  # seconds

_uses: Counter[str] = Counter()
_uses_lock = threading.Lock()


def process_index() -> int:
    return int(jax.process_index())


def process_count() -> int:
    return int(jax.process_count())


def _client() -> Any:
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise CoordinationError(
            f"{process_count()} processes but jax.distributed is not initialized; "
            "call jax.distributed.initialize() first"
        )
    return client


def unique_name(label: str) -> str:
    """A name no earlier call in this process produced; equal across processes that make
    the same calls with ``label`` in the same order (as SPMD programs do). Counted per
    label, so operations with different labels (a save and the manager's keep policy,
    say) may interleave differently on different processes."""
    with _uses_lock:
        _uses[label] += 1
        return f"ckptstore/{label}/{_uses[label]}"


async def kv_set(key: str, value: str) -> None:
    """Publish ``value`` under ``key`` for every process to read."""
    try:
        await asyncio.to_thread(_client().key_value_set, key, value)
    except Exception as exc:
        raise CoordinationError(f"could not publish {key!r}: {exc}") from exc


async def kv_get(key: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    """Wait for and return the value published under ``key``."""
    try:
        value = await asyncio.to_thread(_client().blocking_key_value_get, key, int(timeout * 1000))
    except Exception as exc:
        raise CoordinationError(
            f"process {process_index()}: no value for {key!r} within {timeout:g} s: {exc}"
        ) from exc
    return str(value)


async def kv_try_get(key: str) -> str | None:
    """The value published under ``key``, or None if none is (without waiting)."""
    try:
        value = await asyncio.to_thread(_client().key_value_try_get, key)
    except Exception as exc:
        if "NOT_FOUND" in str(exc):
            return None
        raise CoordinationError(f"could not read {key!r}: {exc}") from exc
    return str(value)
