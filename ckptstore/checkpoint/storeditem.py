"""One stored item as restore sees it, whatever format wrote it.

A native ckptstore step and an Orbax checkpoint differ in where their leaves
live and how the tree is described; once both are a `StoredItem` (leaf schema,
tree structure, a way to open each leaf as a TensorStore array), restore checks,
reshards and casts them the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import tensorstore as ts

from ckptstore.format.leaves import Index, LeafInfo

T = TypeVar("T")


@dataclass(frozen=True)
class StoredItem:
    """The leaves of one item, the JSON tree structure (`ckptstore.format.tree`
    format) that names them, and ``open(info)``: the leaf's array, ready to read.

    Where the format has them: ``read_small(infos)`` reads many small single-chunk
    leaves (`ckptstore.format.chunks.small`) whole, in one batch; ``open_raw(infos)`` gives
    each leaf a faster reader of its regions than its TensorStore array, or None.
    """

    leaves: dict[str, LeafInfo]
    structure: dict[str, Any]
    open: Callable[[LeafInfo], Awaitable[ts.TensorStore]]
    read_small: Callable[[Sequence[LeafInfo]], Awaitable[list[np.ndarray[Any, Any]]]] | None = None
    open_raw: Callable[[Sequence[LeafInfo]], Awaitable[Sequence[Read | None]]] | None = None


Read = Callable[[Index], Awaitable[np.ndarray[Any, Any]]]


async def settle(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Like `asyncio.gather`, but every read finishes before the first error is raised,
    so no TensorStore future completes after the caller (or its event loop) is gone."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
