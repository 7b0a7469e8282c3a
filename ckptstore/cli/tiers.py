"""The ``ckptstore`` command on tiers: ``promote`` (once, or ``--watch``) and ``ls`` of a
profile with a ``[tiers]`` table (``info``, ``verify``, ``rm`` and ``gc`` take tiers through
the ordinary commands)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptstore.backends.base import Backend
from ckptstore.cli.output import EXIT_OK, EXIT_UNREADABLE, Output, print_json
from ckptstore.cli.steps import entries, print_entries
from ckptstore.cli.text import count, duration_text, human
from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.protocol import committed_steps, is_committed
from ckptstore.tiers.promote import Promotion, promote, unpromoted
from ckptstore.tiers.status import status
from ckptstore.tiers.target import Tiered

T = TypeVar("T")

_TIER_TEXT = {
    "fast": "fast only",
    "both": "fast + durable",
    "durable": "durable only",
    "staged": "staged on this host (multi-host: merged on the durable tier by promotion)",
}


def _state_text(state: str, uploaded: float | None) -> str:
    text = _TIER_TEXT[state]
    if uploaded is None:
        return text
    if uploaded > 0:
        part = " of this host's part" if state == "staged" else ""
        return f"{text}, promoting: {100 * uploaded:.0f}%{part} on the durable tier"
    return f"{text}, not promoted yet"


async def cmd_ls_all_tiers(profile: str, as_json: bool) -> int:
    """``ls --all`` of a tiers profile: every entry of each tier, fast then durable."""
    tiers = Tiered.from_profile(profile)
    async with tiers.opened() as (fast, durable):
        found = {"fast": await entries(fast), "durable": await entries(durable)}
        urls = {"fast": fast.url, "durable": durable.url}
    if as_json:
        print_json(found)
        return EXIT_OK
    for name, rows in found.items():
        print(f"{name} tier, {urls[name]}:")
        print_entries(rows, urls[name])
    return EXIT_OK


async def cmd_ls_tiers(profile: str, as_json: bool) -> int:
    """Each step's tiers (fast only, promoting with a percentage, both, durable only, or
    staged on this host), and how far promotion lags behind."""
    tiered = Tiered.from_profile(profile)
    report = await status(tiered)
    lagging = report.lagging
    times = [t for s in lagging if (t := report.saved.get(s)) is not None]
    lag = time.time() - min(times) if times else None
    code = EXIT_OK if report.durable_error is None else EXIT_UNREADABLE
    if as_json:
        doc = {
            "steps": report.steps,
            "uploaded": report.uploaded,
            "unpromoted": lagging,
            "lag_seconds": lag,
            "durable_error": report.durable_error,
        }
        print_json(doc)
        return code
    if report.durable_error is not None:
        print(f"the durable tier does not answer, the fast tier's steps: {report.durable_error}")
    if not report.steps:
        print(f"no committed checkpoints on either tier of {profile}")
        return code
    print(f"{'STEP':>10}  TIERS")
    for step, state in report.steps.items():
        print(f"{step:>10}  {_state_text(state, report.uploaded.get(step))}")
    if not lagging:
        print("promotion lag: none")
    else:
        oldest = "" if lag is None else f", the oldest saved {duration_text(lag)} ago"
        print(f"promotion lag: {count(len(lagging), 'step')} not durable yet{oldest}")
    return code


class Signals:
    """SIGINT and SIGTERM while a command runs: recorded, and what the command awaits
    through `run` or `sleep` is cancelled, so it stops between (or inside) promotions
    instead of being killed with a traceback."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._event = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __enter__(self) -> Signals:
        # Only the main thread receives signals (`main` may run on another: then as usual).
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            for sig in self.SIGNALS:
                self._loop.add_signal_handler(sig, self._handle, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            for sig in self.SIGNALS:
                self._loop.remove_signal_handler(sig)

    def _handle(self, signum: int) -> None:
        self.received = signum
        self._event.set()

    async def run(self, work: Coroutine[Any, Any, T]) -> T | None:
        """``work``'s result, or None when a signal came first (``work`` is cancelled)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        return task.result()

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; True when a signal cut the wait short."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), seconds)
        return self._event.is_set()


def _done_text(p: Promotion) -> str:
    if p.already:
        return f"step {p.step}: already durable"
    return (
        f"step {p.step}: copied {p.copied} of {count(p.objects, 'object')}, "
        f"{human(p.bytes)} in {p.seconds:.1f} s"
    )


def _done_json(p: Promotion) -> dict[str, Any]:
    return {"step": p.step, "event": "already durable" if p.already else "promoted"} | {
        k: getattr(p, k) for k in ("attempt", "objects", "copied", "bytes", "seconds")
    }


class _Say:
    """What promote reports: text lines, or (``--json``) JSON documents: one at the end
    of a one-off promotion, one per line as things happen with ``--watch``."""

    def __init__(self, as_json: bool, watch: bool) -> None:
        self.as_json, self.watch = as_json, watch
        self.events: list[dict[str, Any]] = []

    def __call__(self, text: str, doc: dict[str, Any]) -> None:
        if not self.as_json:
            print(text, flush=True)
        elif self.watch:
            print(json.dumps(doc), flush=True)
        else:
            self.events.append(doc)


async def cmd_promote(
    profile: str,
    step: int | None,
    out: Output,
    *,
    watch: bool = False,
    interval: float = 5.0,
) -> int:
    """Promote the unpromoted committed steps (or ``step``), oldest first, one at a time;
    with ``watch``, keep doing so every ``interval`` seconds until SIGINT or SIGTERM.

    Exit status: 0; a signal stops ``--watch`` with 0 (an interrupted promotion is resumed
    by the next one: the durable tier lists a step only once its marker landed, last) and a
    one-off promotion with 128 + the signal's number.
    """
    if watch and step is not None:
        raise ConfigError("--watch promotes every step as it is committed: give no --step")
    if interval <= 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {interval}")
    tiered = Tiered.from_profile(profile)
    say = _Say(out.json, watch)
    with Signals() as signals:
        async with tiered.opened() as (fast, durable):
            tiers = dataclasses.replace(tiered, fast=fast, durable=durable)
            if watch:
                say(
                    f"watching {fast.url} every {interval:g} s for steps to promote to "
                    f"{durable.url} (SIGINT or SIGTERM stops)",
                    {"event": "watching", "fast": fast.url, "durable": durable.url},
                )
            while True:
                todo = [step] if step is not None else await unpromoted(fast, durable)
                for s in todo:
                    if signals.received is not None:  # came while listing: start nothing
                        break
                    if not await _promote_one(tiers, s, out, say, signals, skip_gone=watch):
                        break
                if signals.received is not None or not watch or await signals.sleep(interval):
                    break
            durable_now = await committed_steps(durable)
    name = None if signals.received is None else signal.Signals(signals.received).name
    status = 0 if name is None or watch else 128 + (signals.received or 0)
    if out.json:
        end = {"event": "stopped" if watch else "done", "durable": durable_now, "signal": name}
        if watch:  # the last of its lines
            print(json.dumps(end), flush=True)
        else:
            print_json(end | {"steps": say.events})
        return status
    print(f"durable now: {durable_now}", flush=True)
    if name is not None:
        print(f"stopped by {name}", flush=True)
    return status


async def _promote_one(
    tiers: Tiered, step: int, out: Output, say: _Say, signals: Signals, *, skip_gone: bool
) -> bool:
    """Promote one step, reporting its progress and outcome; False when a signal stopped it."""
    bar = out.bar(f"step {step}:")
    try:
        done = await signals.run(promote(tiers, step, progress=bar.update))
    except CheckpointNotFoundError as exc:
        if not skip_gone:
            raise
        # deleted or trimmed meanwhile
        say(f"step {step}: skipped, {exc}", {"event": "skipped", "step": step, "why": str(exc)})
        return True
    finally:
        bar.close()
    if done is None:
        # The signal may have come after the durable marker landed, before the report.
        assert isinstance(tiers.durable, Backend)  # opened by cmd_promote
        durable = await is_committed(tiers.durable, step)
        said = "durable (the signal came as it ended)" if durable else "not durable"
        say(
            f"step {step}: interrupted, {said}"
            + ("" if durable else " (promoting again resumes it)"),
            {"event": "interrupted", "step": step, "durable": durable},
        )
        return False
    for p in done:
        say(_done_text(p), _done_json(p))
    return True
