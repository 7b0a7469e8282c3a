"""The retry policy's deadline, applied to TensorStore's own requests.

TensorStore's S3 and GCS drivers have no per-request timeout: a server that accepts a
connection and never answers is given up on only by curl's stall timer
(``$TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``, 60 s unless set), once per retry, so a
black hole held one TensorStore read or write for six minutes under the default policy.
An object-store backend binds its `RetryPolicy` to its TensorStore context (`bind`);
the data path awaits each TensorStore future through `within`, which cancels the future
once the policy's limit for the bytes it moves (``deadline + nbytes / min_rate``, as for
the byte API) has passed and raises `RetriesExhaustedError`.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, TypeVar

from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import RetriesExhaustedError

T = TypeVar("T")

_POLICIES: weakref.WeakKeyDictionary[Any, RetryPolicy] = weakref.WeakKeyDictionary()


def bind(owner: Any, policy: RetryPolicy | None) -> None:
    """Make ``policy`` govern TensorStore futures awaited on behalf of ``owner`` (a
    `tensorstore.Context`, or a `tensorstore.TensorStore` opened with one)."""
    if policy is not None:
        _POLICIES[owner] = policy


def policy_of(owner: Any) -> RetryPolicy | None:
    """The policy bound to ``owner``, or None (no deadline: local disk, memory)."""
    try:
        return _POLICIES.get(owner)
    except TypeError:  # not weakly referenceable: nothing was bound to it
        return None


async def within(future: Any, owner: Any, nbytes: int, what: str) -> Any:
    """The result of the TensorStore ``future``, or `RetriesExhaustedError` once the
    deadline that ``owner``'s policy gives ``nbytes`` has passed (the future is then
    cancelled: TensorStore drops the request). A cancelled caller cancels it too."""
    policy = policy_of(owner)
    limit = None if policy is None else policy.limit(nbytes)
    if limit is None:
        return await future
    inner = asyncio.ensure_future(future)
    try:
        done, _ = await asyncio.wait([inner], timeout=limit)
    except asyncio.CancelledError:
        _cancel(future, inner)
        raise
    if inner not in done:
        _cancel(future, inner)
        await asyncio.wait([inner])
        if inner.cancelled() or inner.exception() is not None:
            raise RetriesExhaustedError(
                f"{what}: no result within the {limit:.0f} s deadline (retry policy)"
            )
    return inner.result()


def _cancel(future: Any, inner: asyncio.Future[Any]) -> None:
    cancel = getattr(future, "cancel", None)
    if cancel is not None:
        cancel()
    inner.cancel()
