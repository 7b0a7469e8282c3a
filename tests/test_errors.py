"""Error messages: each names its backend and key once."""

from __future__ import annotations

import pytest

from ckptstore.backends.retry import RetryPolicy, retry_async
from ckptstore.errors import RetriesExhaustedError, TransientStorageError


async def test_retries_exhausted_names_backend_and_key_once() -> None:
    async def op(attempt: int) -> None:
        raise TransientStorageError("read failed: reset", backend="s3://b/run", key="7/x")

    with pytest.raises(RetriesExhaustedError) as info:
        await retry_async(op, RetryPolicy(max_attempts=2, base_delay=0.001))
    text = str(info.value)
    assert text == "gave up after 2 attempts: read failed: reset (backend s3://b/run, key '7/x')"
    assert info.value.message == "gave up after 2 attempts: read failed: reset"
