"""Cross-process agreement through jax.distributed's coordination service.

A key-value store whose reads wait with a timeout and fail with a clear error.
Single-process code never calls it (see `ckptstore.checkpoint.handoff`).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import jax

from ckptstore.errors import CoordinationError

DEFAULT_TIMEOUT = 600.0  # seconds

_sequence = itertools.count()


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
    """A name no earlier call in this process produced; equal across processes that
    make the same sequence of calls (as SPMD programs do)."""
    return f"ckptstore/{label}/{next(_sequence)}"


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
