"""Preemption on `CheckpointManager` (which inherits `Preemption`): one process learns it
from SIGTERM; several learn it together from JAX's preemption sync point, which names one
step every process saves. `CheckpointManager.preempted` tells the loop to stop once that
step is saved; the save policy saves it whatever it would say otherwise.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

log = logging.getLogger("ckptstore")


class Preemption:
    """SIGTERM and JAX's preemption sync point (see the module docstring)."""

    if TYPE_CHECKING:  # what the manager provides
        _count: int
        _preempted: threading.Event
        _previous_handler: Any

    @property
    def preempted(self) -> bool:
        """Whether the job is being preempted, so the loop should stop once this step is
        saved: this process got SIGTERM (one process), or every process reached JAX's
        preemption sync point at the same step (several; `save` must then be called at
        every step, as the sync point is one step that every process must pass through)."""
        return self._preempted.is_set()

    def _check_preemption(self, step: int) -> bool:
        if self._count > 1 and not self._preempted.is_set():
            # SIGTERM on any process reaches every process through JAX's coordination
            # service, which names one step (the largest any process had reached, plus
            # one) that all of them then save: a process's own signal is not enough.
            if _reached_preemption_sync_point(step):
                log.warning("ckptstore: preemption: every process saves step %d", step)
                self._preempted.set()
        return self._preempted.is_set()

    def _install_sigterm(self) -> None:
        if self._count > 1:
            return  # JAX's preemption service owns SIGTERM in multi-process jobs
        if threading.current_thread() is not threading.main_thread():
            log.warning("ckptstore: SIGTERM not handled: the manager is not on the main thread")
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self._preempted.set()
            if callable(self._previous_handler):
                self._previous_handler(signum, frame)

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)


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
