"""The ``<step>/STAGED`` record: a step staged on a host-local fast tier, not committed
(see `ckptstore.tiers.hostlocal`, which writes and promotes it). Here because any reader of
a fast tier's steps must know it: `gc` keeps what a staged step names."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.format import layout

STAGED = "STAGED"


def staged_key(step: int) -> str:
    return f"{layout.step_dir(step)}/{STAGED}"


@dataclass(frozen=True)
class Staged:
    """The content of ``<step>/STAGED`` on one process's fast tier."""

    step: int
    attempt: str
    process: int
    processes: int
    manifest_digest: str | None = None  # process 0's marker only
    host_view: bool = False  # this host holds every slice its devices held (`write_host_view`)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": layout.FORMAT,
                "step": self.step,
                "attempt": self.attempt,
                "process": self.process,
                "processes": self.processes,
                "manifest_digest": self.manifest_digest,
                "host_view": self.host_view,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, step: int, where: str) -> Staged:
        try:
            doc = json.loads(data)
            if doc.get("format") != layout.FORMAT or doc.get("step") != step:
                raise ValueError("not a staged-step marker of this step")
            if not layout.is_attempt(doc["attempt"]):
                raise ValueError("no valid attempt")
            return cls(
                step, doc["attempt"], int(doc["process"]), int(doc["processes"]),
                doc.get("manifest_digest"), doc.get("host_view") is True,
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptCheckpointError(f"unreadable staged-step marker {where}: {exc}") from exc


async def read_staged(fast: Backend, step: int) -> Staged | None:
    try:
        data = await fast.read(staged_key(step))
    except NotFoundError:
        return None
    return Staged.from_bytes(data, step=step, where=f"{fast.url}/{staged_key(step)}")


async def staged_steps(fast: Backend) -> list[int]:
    """Steps with a ``STAGED`` marker on this fast tier, ascending."""
    steps = sorted(s for s in map(layout.parse_step, await fast.list_dir()) if s is not None)
    return [s for s in steps if await fast.exists(staged_key(s))]
