"""The commit protocol (format version 2): attempts, the marker, the digest, read-side checks.

Writers: a save (or a partial-save session) writes only below its own attempt
directory ``<step>/<attempt>/``; nothing outside it is ever deleted or
overwritten. The commit is one create-if-absent of ``<step>/COMMITTED``, naming
the attempt and carrying the sha256 of that attempt's ``manifest.json``: the
first writer to create it wins, every other gets `AlreadyExistsError`.

Readers start from the marker and trust nothing they have not checked: the marker
must parse and name this step; the manifest it points to must have the digest it
carries and name the same step and attempt. Anything else is
`CorruptCheckpointError`, never data from another step or attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.checkpoint import layout
from ckptstore.checkpoint.layout import AttemptDir
from ckptstore.checkpoint.manifest import Manifest
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidKeyError,
    NotFoundError,
)


def digest(data: bytes) -> str:
    """The digest a marker carries for its manifest."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Marker:
    """The content of ``<step>/COMMITTED``. ``attempt`` is None for a version-1 step."""

    step: int
    attempt: str | None
    manifest_digest: str | None
    token: str = ""
    time: float = 0.0

    @property
    def where(self) -> AttemptDir:
        return AttemptDir(self.step, self.attempt)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": layout.FORMAT,
                "format_version": layout.FORMAT_VERSION,
                "step": self.step,
                "attempt": self.attempt,
                "manifest_digest": self.manifest_digest,
                "token": self.token,  # unique: a retried create recognizes its own marker
                "time": self.time,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, step: int, where: str) -> Marker:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("step") != step or isinstance(doc.get("step"), bool):
                raise ValueError(f"it names step {doc.get('step')!r}")
            if "attempt" not in doc:  # format version 1: the step directory is the attempt
                return cls(step=step, attempt=None, manifest_digest=None)
            attempt, dig = doc["attempt"], doc["manifest_digest"]
            if doc.get("format") != layout.FORMAT or not isinstance(attempt, str):
                raise ValueError("not a ckptstore commit marker")
            version = doc.get("format_version")
            if not isinstance(version, int) or version > layout.FORMAT_VERSION:
                raise ValueError(f"format version {version!r} is newer than this ckptstore reads")
            if not layout.is_attempt(attempt):
                raise ValueError(f"it names no valid attempt ({attempt[:80]!r})")
            if not isinstance(dig, str) or not dig.startswith("sha256:") or len(dig) != 71:
                raise ValueError("bad manifest digest")
            when = doc.get("time", 0.0)  # informational: `ckptstore info` derives the commit's
            if isinstance(when, bool) or not isinstance(when, (int, float)):  # duration
                when = 0.0
            when = float(when) if math.isfinite(when) else 0.0
            return cls(step=step, attempt=attempt, manifest_digest=dig, time=when)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable commit marker {where}: {exc}") from exc


# ---- writers ----


async def ensure_uncommitted(backend: Backend, step: int) -> None:
    """Raise `AlreadyExistsError` if ``step`` is committed (a fast, early refusal)."""
    if await backend.exists(layout.commit_key(step)):
        raise AlreadyExistsError(
            f"checkpoint step {step} is already committed",
            backend=backend.url,
            key=layout.commit_key(step),
        )


async def commit(backend: Backend, manifest: Manifest) -> Marker:
    """Write the attempt's manifest, then create the marker: the step is committed after this.

    Raises `AlreadyExistsError` if another attempt committed the step first; this
    attempt is then left as it is (garbage for `gc`), and the winner is untouched.
    """
    if manifest.attempt is None:
        raise ValueError("only attempt-scoped (format version 2) checkpoints are written")
    where = AttemptDir(manifest.step, manifest.attempt)
    data = manifest.to_bytes()
    # What a reader would refuse is never committed (a hand-edited part record, say).
    Manifest.from_bytes(data, where=f"{backend.url}/{where.manifest} (not written)")
    await backend.write(where.manifest, data)
    await backend.sync_dirs(where.root)  # every directory the attempt created, before the marker
    marker = Marker(
        step=manifest.step,
        attempt=manifest.attempt,
        manifest_digest=digest(data),
        token=secrets.token_hex(16),
        time=time.time(),
    )
    try:
        await backend.create(layout.commit_key(manifest.step), marker.to_bytes())
    except AlreadyExistsError as exc:
        raise AlreadyExistsError(
            f"step {manifest.step} was committed by another writer first; "
            f"attempt {manifest.attempt} was not committed",
            backend=backend.url,
            key=layout.commit_key(manifest.step),
        ) from exc
    return marker


# ---- readers ----


async def committed_steps(backend: Backend) -> list[int]:
    """Steps with a commit marker, ascending (the markers are not opened)."""
    candidates = sorted(
        s for s in (layout.parse_step(n) for n in await backend.list_dir()) if s is not None
    )
    flags = await asyncio.gather(*(_has_marker(backend, s) for s in candidates))
    return [s for s, ok in zip(candidates, flags, strict=True) if ok]


async def _has_marker(backend: Backend, step: int) -> bool:
    try:
        return await backend.exists(layout.commit_key(step))
    except InvalidKeyError:  # the step's directory leads out of the root (a symlink): listed,
        return True  # so that reading it says so (`read_marker`) rather than hiding it


async def read_marker(backend: Backend, step: int) -> Marker | None:
    """The parsed marker of ``step``, or None if the step is not committed."""
    key = layout.commit_key(step)
    try:
        data = await backend.read(key)
    except NotFoundError:
        return None
    except InvalidKeyError as exc:
        raise CorruptCheckpointError(f"step {step} cannot be read: {exc}") from exc
    return Marker.from_bytes(data, step=step, where=f"{backend.url}/{key}")


async def load_committed(backend: Backend, step: int) -> Manifest:
    """The verified manifest of committed ``step``.

    Raises `CheckpointNotFoundError` if the step is not committed and
    `CorruptCheckpointError` if the marker, the manifest or their agreement fails.
    """
    marker = await read_marker(backend, step)
    if marker is None:
        raise CheckpointNotFoundError(
            f"step {step} is not committed", backend=backend.url, key=layout.commit_key(step)
        )
    return await load_manifest(backend, marker)


async def load_manifest(backend: Backend, marker: Marker) -> Manifest:
    """The manifest ``marker`` names, checked against it."""
    key = marker.where.manifest
    where = f"{backend.url}/{key}"
    try:
        data = await backend.read(key)
    except NotFoundError as exc:
        raise CorruptCheckpointError(
            f"step {marker.step} is committed but its manifest {where} is missing"
        ) from exc
    if marker.manifest_digest is not None and digest(data) != marker.manifest_digest:
        raise CorruptCheckpointError(
            f"manifest {where} does not match the digest in its commit marker "
            "(changed after the commit)"
        )
    manifest = Manifest.from_bytes(data, where=where)
    if manifest.step != marker.step or manifest.attempt != marker.attempt:
        raise CorruptCheckpointError(
            f"manifest {where} describes step {manifest.step} attempt {manifest.attempt}, "
            f"not step {marker.step} attempt {marker.attempt}"
        )
    return manifest


async def resolve_step(backend: Backend, step: int | None) -> int:
    """``step`` itself, checked, or the latest committed step when None."""
    if step is not None:
        return layout.check_step(step)
    steps = await committed_steps(backend)
    if not steps:
        raise CheckpointNotFoundError("no committed checkpoint", backend=backend.url)
    return steps[-1]


async def latest_manifest(backend: Backend, step: int | None = None) -> Manifest:
    """The verified manifest of ``step``, or of the latest committed step when None."""
    return await load_committed(backend, await resolve_step(backend, step))
