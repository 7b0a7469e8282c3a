"""Helpers for the scripts that tests run in a subprocess and then kill."""

from __future__ import annotations

import asyncio
from typing import Any

import tensorstore as ts


async def first_bytes(store: dict[str, Any], context: ts.Context, *_: Any) -> None:
    """Wait until the OCDBT store being written (``write_leaves``'s first two arguments)
    has its first object on storage, so a kill lands mid-write."""
    base = await ts.KvStore.open(store["base"], context=context)
    for _ in range(2000):
        if await base.list():
            return
        await asyncio.sleep(0.005)
    raise SystemExit("the write never started")
