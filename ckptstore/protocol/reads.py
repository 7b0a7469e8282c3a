"""The read side of the protocol: committed steps, their markers and their manifests, each
checked before it is believed.

Readers start from the marker and trust nothing they have not checked: the marker must
parse and name this step; the manifest it points to must have the digest it carries and name
the same step and attempt. Anything else is `CorruptCheckpointError`, never data from
another step or attempt.
"""

from __future__ import annotations

import asyncio

from ckptstore.backends.base import Backend
from ckptstore.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidKeyError,
    NotFoundError,
)
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol.markers import Marker, digest, step_records
from ckptstore.protocol.recent import RECENT
from ckptstore.runtime.futures import off_loop


async def committed_steps(backend: Backend) -> list[int]:
    """Steps with a current commit marker, ascending (the markers are not opened)."""
    candidates = sorted(
        s for s in (layout.parse_step(n) for n in await backend.list_dir()) if s is not None
    )
    flags = await asyncio.gather(*(is_committed(backend, s) for s in candidates))
    return [s for s, ok in zip(candidates, flags, strict=True) if ok]


async def is_committed(backend: Backend, step: int) -> bool:
    """Whether ``step`` has a current commit marker (not opened)."""
    try:
        return (await step_records(backend, step)).current is not None
    except InvalidKeyError:  # the step's directory leads out of the root (a symlink): listed,
        return True  # so that reading it says so (`read_marker`) rather than hiding it


async def read_marker_bytes(backend: Backend, step: int) -> tuple[int, bytes] | None:
    """The index and content of ``step``'s current marker, or None if it is not committed
    (a marker deleted between the listing and its read counts as deleted)."""
    try:
        index = (await step_records(backend, step)).current
        if index is None:
            return None
        return index, await backend.read(layout.commit_key(step, index))
    except NotFoundError:
        return None
    except InvalidKeyError as exc:
        raise CorruptCheckpointError(f"step {step} cannot be read: {exc}") from exc


async def same_commit(a: Backend, b: Backend, step: int) -> bool:
    """Whether ``a`` and ``b`` both have ``step`` committed by byte-identical markers (a
    promoted copy and its original)."""
    x, y = await asyncio.gather(read_marker_bytes(a, step), read_marker_bytes(b, step))
    return x is not None and y is not None and x[1] == y[1]


async def read_marker(backend: Backend, step: int) -> Marker | None:
    """The parsed current marker of ``step``, or None if the step is not committed."""
    found = await read_marker_and_bytes(backend, step)
    return None if found is None else found[1]


async def read_marker_and_bytes(backend: Backend, step: int) -> tuple[bytes, Marker] | None:
    """`read_marker`, with the marker's bytes as stored (what a promotion copies)."""
    found = await read_marker_bytes(backend, step)
    if found is None:
        return None
    index, data = found
    key = layout.commit_key(step, index)
    return data, Marker.from_bytes(data, step=step, where=f"{backend.url}/{key}", index=index)


async def load_committed(backend: Backend, step: int, *, recent: bool = False) -> Manifest:
    """The verified manifest of committed ``step``.

    Raises `CheckpointNotFoundError` if the step is not committed and
    `CorruptCheckpointError` if the marker, the manifest or their agreement fails.
    ``recent`` (an incremental save reading its base): a manifest this process committed
    lately (`RecentCommits`) is taken as it is when the marker names its attempt and its
    bytes' digest, not read and parsed again; restores and verify always read what is stored.
    """
    marker = await read_marker(backend, step)
    if marker is None:
        raise CheckpointNotFoundError(
            f"step {step} is not committed; {await _what_is_there(backend)}",
            backend=backend.url,
            key=layout.commit_key(step),
        )
    known = RECENT.get(step, marker.attempt, marker.manifest_digest) if recent else None
    return known if known is not None else await load_manifest(backend, marker)


async def _what_is_there(backend: Backend) -> str:
    """For an error about a step that is not there: the committed steps (the last few),
    or that there are none, or that the root itself does not exist (a mistyped path)."""
    steps = await committed_steps(backend)
    if steps:
        shown = ", ".join(map(str, steps[-SHOWN_STEPS:]))
        more = f" (the last {SHOWN_STEPS} of {len(steps)})" if len(steps) > SHOWN_STEPS else ""
        return f"committed steps: {shown}{more}"
    try:
        await backend.check_root()
    except NotFoundError as exc:
        return exc.message
    return "no step is committed there"


#: How many committed steps an error about a missing one names.
SHOWN_STEPS = 10


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
    # Parsing costs about as much as copying 16 times the bytes: a large manifest's parse
    # runs on a worker thread rather than hold the event loop.
    manifest = await off_loop(lambda: Manifest.from_bytes(data, where=where), 16 * len(data))
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
        raise CheckpointNotFoundError(
            f"no committed checkpoint: {await _what_is_there(backend)}", backend=backend.url
        )
    return steps[-1]


async def latest_manifest(backend: Backend, step: int | None = None) -> Manifest:
    """The verified manifest of ``step``, or of the latest committed step when None."""
    return await load_committed(backend, await resolve_step(backend, step))
