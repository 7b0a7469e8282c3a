"""`ByteBudget`: how many bytes of copies a save, restore or promotion holds at once."""

from __future__ import annotations

import asyncio
import collections
import contextlib


class ByteBudget:
    """An async semaphore counted in bytes; one piece larger than the budget may pass alone.

    ``async with budget.hold(nbytes): ...`` (the save's shard copies, promotion's objects).
    Waiters are admitted first come, first served, and a release wakes only those that
    now fit, so thousands of small waiters cost no more than a few large ones.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0  # the most bytes ever held at once
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def hold(self, nbytes: int) -> _Hold:
        return _Hold(self, nbytes)

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit

    async def _acquire(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, waiter))
        try:
            await waiter  # _wake counted our bytes in before resolving it
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # admitted, then cancelled
                self._release(nbytes)
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove((nbytes, waiter))
                self._wake()
            raise

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            nbytes, waiter = self._waiters[0]
            if waiter.done():  # cancelled (with its task) and not yet gone from the queue
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                break
            self._waiters.popleft()
            self._take(nbytes)
            waiter.set_result(None)

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)


class _Hold:
    def __init__(self, budget: ByteBudget, nbytes: int):
        self.budget, self.nbytes = budget, nbytes

    async def __aenter__(self) -> None:
        await self.budget._acquire(self.nbytes)

    async def __aexit__(self, *exc: object) -> None:
        self.budget._release(self.nbytes)
