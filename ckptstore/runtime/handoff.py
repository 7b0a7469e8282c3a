"""SPMD hand-offs between processes for one save, through the coordination key-value store.

A save alternates two kinds of rounds:

- `Handoff.everyone`: every process does its own work and publishes a JSON report;
- `Handoff.primary`: process 0 does work (reading the reports with `Handoff.reports`)
  and publishes the outcome, which every other process waits for.

A failure is published instead of a report or an outcome, so the other processes
stop at once with the error rather than waiting for a barrier to time out. A process doing
a round's work beats meanwhile (`ckptstore.runtime.beats`): those waiting for it wait as
long as it works (a promotion of a large step, say), and ``timeout`` past its last beat.
With one process nothing is published: reports and errors stay in this process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ckptstore import errors
from ckptstore.errors import CkptStoreError
from ckptstore.runtime import distributed
from ckptstore.runtime.beats import beating, wait_while_beating

T = TypeVar("T")

#: Errors re-raised with their own type on the processes that learn of them remotely,
#: so that, say, losing a commit race is `AlreadyExistsError` on every process and a
#: durable tier that is down is `TransientStorageError` on every process (each defers the
#: promotion alike). A failure is published as the first of these it is an instance of:
#: subclasses come before their bases.
_TYPED = (
    errors.FencedError,
    errors.AlreadyExistsError,
    errors.BaseStepGoneError,  # the manager's incremental saves retry on this one
    errors.CheckpointNotFoundError,
    errors.CorruptCheckpointError,
    errors.PermissionDeniedError,
    errors.CoordinationError,
    errors.InsufficientSpaceError,
    errors.RetriesExhaustedError,
    errors.TransientStorageError,
)


def _failure(exc: BaseException) -> str:
    typed = next((cls.__name__ for cls in _TYPED if isinstance(exc, cls)), None)
    return json.dumps({"ok": False, "type": type(exc).__name__, "typed": typed, "error": str(exc)})


def _remote_error(outcome: dict[str, Any], where: str) -> CkptStoreError:
    """The error a peer published, as the most specific type we can rebuild."""
    text = f"{where}: {outcome.get('type', 'Error')}: {outcome.get('error')}"
    for cls in _TYPED:
        if outcome.get("typed") == cls.__name__:
            return cls(text)
    return CkptStoreError(text)


class Handoff:
    """The hand-offs of one collective operation (a save, a partial-save step)."""

    def __init__(self, label: str, timeout: float = distributed.DEFAULT_TIMEOUT):
        self.label = label
        self.tag = distributed.unique_name(label)
        self.timeout = timeout
        self.me = distributed.process_index()
        self.count = distributed.process_count()
        self._round = 0
        self._reported = -1  # the round of the last `everyone`
        self._mine: dict[str, Any] = {}  # this process's last report

    async def _publish(self, key: str, value: str) -> None:
        if self.count > 1:  # alone, nobody else would read it
            await distributed.kv_set(key, value)

    def _outcome_key(self) -> str:
        return f"{self.tag}/outcome/{self._round}"

    def _report_key(self, process: int, round_: int | None = None) -> str:
        return f"{self.tag}/report/{self._round if round_ is None else round_}/{process}"

    def _beats(self, kind: str, process: int) -> str:
        """Where ``process`` beats while it does this round's ``kind`` of work (`beats`)."""
        return f"{self.tag}/beat/{self._round}/{kind}/{process}"

    async def everyone(self, work: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Run this process's share and publish its report (or its failure)."""
        self._reported = self._round
        try:
            async with beating(self._beats("share", self.me), self.timeout, self.count == 1):
                report = await work()
        except Exception as exc:
            await self._publish(self._report_key(self.me), _failure(exc))
            if self.me == 0:  # the others wait for process 0's next outcome: fail it now
                await self._publish(self._outcome_key(), _failure(exc))
            raise
        await self._publish(self._report_key(self.me), json.dumps({"ok": True, **report}))
        self._mine = report
        return report

    async def reports(self) -> list[dict[str, Any]]:
        """On process 0: every process's report of the last `everyone` round, in order."""
        if self.count == 1:
            return [self._mine]
        out = []
        for i in range(self.count):
            key, beats = self._report_key(i), self._beats("share", i)
            report = json.loads(await wait_while_beating(key, beats, self.timeout))
            if not report.pop("ok"):
                raise _remote_error(report, f"process {i} failed")
            out.append(report)
        return out

    async def settled(self, wait: float) -> bool:
        """On process 0: whether every process published its report of the last `everyone`
        round (done or failed) within ``wait`` seconds, so that none is still doing that
        round's work. Reports are read, never raised: this runs after a failure."""
        if self.count == 1 or self._reported < 0:  # alone, or no round has run: none works
            return True
        deadline = time.monotonic() + wait
        for i in range(self.count):
            left = deadline - time.monotonic()
            try:
                await distributed.kv_get(self._report_key(i, self._reported), max(left, 0.001))
            except errors.CoordinationError:
                return False
        return True

    async def agree(self, decide: Callable[[], Awaitable[str]]) -> str:
        """Process 0 decides a value (an attempt id, a directory name); everyone gets it."""
        return str(await self._primary(decide, share=True))

    async def primary(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """Process 0 runs ``work`` and publishes the outcome; the others wait for it.

        Returns ``work``'s result on process 0 and None elsewhere; raises
        everywhere if it failed.
        """
        return await self._primary(work, share=False)

    async def _primary(self, work: Callable[[], Awaitable[T]], *, share: bool) -> T | None:
        key = self._outcome_key()
        try:
            if self.me == 0:
                try:
                    async with beating(self._beats("outcome", 0), self.timeout, self.count == 1):
                        result = await work()
                except Exception as exc:
                    await self._publish(key, _failure(exc))
                    raise
                shared = {"value": result} if share else {}
                await self._publish(key, json.dumps({"ok": True, **shared}))
                return result
            outcome = json.loads(
                await wait_while_beating(key, self._beats("outcome", 0), self.timeout)
            )
            if not outcome["ok"]:
                raise _remote_error(outcome, f"{self.label} failed on process 0")
            return outcome.get("value")  # type: ignore[no-any-return]
        finally:
            self._round += 1
