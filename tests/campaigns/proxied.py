"""What the campaigns behind a `FaultProxy` share (the fixture is `conftest.behind_proxy`)."""

from __future__ import annotations

from collections.abc import Callable

from ckptstore.backends.base import Backend
from ckptstore.backends.retry import RetryPolicy

#: Quick retries: a campaign injects the faults, it need not wait them out.
POLICY = RetryPolicy(max_attempts=3, base_delay=0.005, max_delay=0.02)

#: Makes a backend on the proxied emulator (keywords as the backend's own).
Make = Callable[..., Backend]
