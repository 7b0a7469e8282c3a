"""Preemption on `CheckpointManager` (the `Preemption` it holds): one process learns it
from SIGTERM; several learn it together from JAX's preemption sync point, which names one
step every process saves. `CheckpointManager.preempted` tells the loop to stop once that
step is saved; the save policy saves it whatever it would say otherwise.

A loop that never reads `preempted` (every script written for Orbax, which leaves SIGTERM
alone) would train on to its last step after a SIGTERM, until the grace period ends in
SIGKILL. So a single process whose loop does not read `preempted` exits on SIGTERM as it
would without ckptstore: the first `save` call after the signal saves as the policy says
(`OnPreemption`: that step); if the loop calls `save` again without having read `preempted`,
that call waits for the save in flight to commit, writes one line on stderr and ends the
process by SIGTERM's default action (`Preemption.exit_unless_heeded`). Where SIGTERM had a
handler of the program's own, or was ignored, that decided: nothing changes.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptstore.lifecycle.handles import SaveHandle

log = logging.getLogger("ckptstore")


class Preemption:
    """SIGTERM and JAX's preemption sync point for one manager (see the module docstring).

    ``count``: the job's processes; ``timeout``: how long the exit on an unheeded SIGTERM
    waits for the save in flight, ``inflight()`` (the manager's, at that moment), before it
    calls ``shutdown`` (the manager's release) and ends the process."""

    def __init__(
        self,
        count: int,
        *,
        timeout: float,
        inflight: Callable[[], SaveHandle | None],
        shutdown: Callable[[], None],
    ) -> None:
        self._count, self._timeout = count, timeout
        self._inflight, self._shutdown = inflight, shutdown
        self._event = threading.Event()  # set by SIGTERM (one process) or the sync point
        self._previous: Any = None  # the SIGTERM handler this one replaced, while installed
        #: Whether a `save` call has seen the preemption (what `preempted` says).
        self._seen = False
        #: Whether the loop ever read `preempted` (then it stops by itself on SIGTERM).
        self._read = False
        #: Whether a SIGTERM came while SIGTERM had its default action (it would have ended
        #: the process: `exit_unless_heeded` ends it, once the step's save is committed).
        self._sigterm_ends_process = False
        self._calls_since_sigterm = 0  # `save` calls since that SIGTERM

    @property
    def preempted(self) -> bool:
        """`CheckpointManager.preempted` (its docstring says what it means)."""
        self._read = True
        return self._seen

    def exit_unless_heeded(self) -> None:
        """At the start of a `save` call: if a SIGTERM that would have ended the process
        came before the previous call, and the loop has not read `preempted` since (nor
        ever), wait for the save in flight (the preemption's, if the policy asked for one)
        to commit within ``timeout``, say so on stderr, and end the process by SIGTERM's
        default action. The call after the signal is the loop's chance to stop."""
        if not self._sigterm_ends_process or self._read:
            return
        if not self._calls_since_sigterm:
            self._calls_since_sigterm += 1
            return
        handle, said = self._inflight(), ""
        if handle is not None:
            try:
                handle.wait(self._timeout)
                said = f" after committing step {handle.step}"
            except Exception as exc:  # the process ends anyway: say what was lost
                said = f"; the save of step {handle.step} did not commit: {exc}"
        print(
            f"ckptstore: SIGTERM: exiting{said} (read CheckpointManager.preempted in the loop "
            "to stop it yourself)",
            file=sys.stderr,
            flush=True,
        )
        self._shutdown()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    def check(self, step: int) -> bool:
        """Whether the job is preempted, as a `save` call of ``step`` sees it (`preempted`
        follows)."""
        if self._count > 1 and not self._event.is_set():
            # SIGTERM on any process reaches every process through JAX's coordination
            # service, which names one step (the largest any process had reached, plus
            # one) that all of them then save: a process's own signal is not enough.
            if _reached_preemption_sync_point(step):
                log.warning("ckptstore: preemption: every process saves step %d", step)
                self._event.set()
        self._seen = self._event.is_set()
        return self._seen

    def install(self) -> None:
        """Handle SIGTERM (one process, on the main thread; JAX's preemption service owns
        it in multi-process jobs), chaining the handler it replaces."""
        if self._count > 1:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("ckptstore: SIGTERM not handled: the manager is not on the main thread")
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self._event.set()
            if callable(self._previous):
                self._previous(signum, frame)
            else:  # the default action would have ended the process (ignored: nothing)
                self._sigterm_ends_process = self._previous in (signal.SIG_DFL, None)

        self._previous = signal.signal(signal.SIGTERM, on_sigterm)

    def uninstall(self) -> None:
        """Give SIGTERM back the handler `install` replaced."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


_warned_no_preemption_service = False


def _reached_preemption_sync_point(step: int) -> bool:
    """JAX's multi-host preemption sync point; False (with a warning, once) where the job
    runs without JAX's preemption service."""
    global _warned_no_preemption_service
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError as exc:  # jax_enable_preemption_service is off
        if not _warned_no_preemption_service:
            _warned_no_preemption_service = True
            log.warning("ckptstore: no preemption handling across processes: %s", exc)
        return False
