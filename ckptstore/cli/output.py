"""How the ``ckptstore`` command answers: exit statuses, ``--json`` documents (errors too),
and the progress line on stderr.

Every command takes ``--json``: it then prints exactly one JSON document on stdout (an
error as ``{"error": {"type": ..., "message": ..., "exit": ...}}``), and never a progress
line. Without it, a progress line (bytes, rate, time left) is drawn on stderr for work
that runs longer than `PROGRESS_AFTER` seconds, only when stderr is a terminal;
``--progress`` draws it from the start whatever stderr is, ``--no-progress`` never.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from ckptstore.errors import CkptStoreError, ConfigError, storage_failed
from ckptstore.runtime.progress import Progress

EXIT_OK, EXIT_CORRUPT, EXIT_ERROR, EXIT_UNREADABLE = 0, 1, 2, 3

#: What each exit status means (``ckptstore --help`` and docs/cli.md list the same).
EXIT_STATUSES = {
    EXIT_OK: "fine",
    EXIT_CORRUPT: "a checkpoint is corrupt (verify, ls, info: stored data is wrong)",
    EXIT_ERROR: "an error: bad usage, a missing target, a bad URL or profile, missing "
    "credentials, a step that is not committed",
    EXIT_UNREADABLE: "the storage failed: unreachable, timed out or refused (permission); "
    "for verify, some data could not be read, so it is unknown whether it is intact",
}

#: Seconds of work before a progress line appears (when stderr is a terminal).
PROGRESS_AFTER = 2.0


def exit_status(exc: CkptStoreError) -> int:
    """The exit status of a command that failed with ``exc``."""
    if isinstance(exc, ConfigError):  # missing credentials too: what to fix is configuration
        return EXIT_ERROR
    return EXIT_UNREADABLE if storage_failed(exc) else EXIT_ERROR


def error_json(kind: str, message: str, status: int) -> dict[str, Any]:
    """The ``--json`` document of a failed command."""
    return {"error": {"type": kind, "message": message, "exit": status}}


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=1))


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (a module function, so that tests can stand in for one)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


@dataclass(frozen=True)
class Output:
    """A command's output settings: ``--json``, and whether and when to draw progress."""

    json: bool = False
    progress: bool = False
    after: float = PROGRESS_AFTER

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Output:
        as_json = bool(getattr(args, "json", False))
        forced = getattr(args, "progress", False)
        if as_json or getattr(args, "no_progress", False):
            return cls(json=as_json)
        if forced:
            return cls(progress=True, after=0.0)
        return cls(progress=stderr_is_terminal(), after=PROGRESS_AFTER)

    def bar(self, label: str, total_items: int | None = None, total_bytes: int = 0) -> Progress:
        """A progress line on stderr, drawn only as these settings say."""
        return Progress(
            total_items, total_bytes, enabled=self.progress, label=label, after=self.after
        )


class JsonArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors, when ``--json`` is among the
    arguments, are a JSON document on stdout (still exit status 2)."""

    json_requested = False

    def error(self, message: str) -> NoReturn:
        if JsonArgumentParser.json_requested:
            print_json(error_json("UsageError", f"{self.prog}: {message}", EXIT_ERROR))
            sys.exit(EXIT_ERROR)
        super().error(message)
