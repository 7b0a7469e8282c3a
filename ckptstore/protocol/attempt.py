"""`Attempt`: one try at saving a step, as one actor handles it: claim its fate, commit it,
abandon it, clear it.

A save (or a partial-save session) writes only below its own attempt directory
``<step>/<attempt>/``; nothing outside it is ever deleted or overwritten. Its actor claims the
attempt's fate before its commit (`Attempt.claim`), writes the manifest and creates the
marker (`Attempt.commit`); an actor that gives up abandons it (`Attempt.abandon`) and clears
what it wrote (`Attempt.clear`), its fate record left as a tombstone.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ckptstore.backends import supports
from ckptstore.backends.base import Backend
from ckptstore.errors import (
    AlreadyExistsError,
    BaseStepGoneError,
)
from ckptstore.format import layout
from ckptstore.format.layout import AttemptDir
from ckptstore.format.manifest import Manifest, Reference
from ckptstore.protocol.fates import ABANDON, COMMIT, Fate, claim, new_owner, read_fate
from ckptstore.protocol.markers import (
    Marker,
    StepRecords,
    create_marker,
    digest,
    step_records,
)
from ckptstore.protocol.reads import read_marker
from ckptstore.protocol.recent import RECENT
from ckptstore.runtime.futures import THREAD_BYTES, gather_first_error, off_loop


@dataclass(frozen=True)
class Attempt:
    """The attempt ``where`` of a step on ``backend``, as the actor ``owner`` handles it.

    ``owner`` is the token the attempt's fate record names when this actor claims it: a
    fresh one unless given (every process of a promotion passes the same, so that a retry
    is recognized as the same actor)."""

    backend: Backend
    where: AttemptDir
    owner: str = field(default_factory=new_owner)

    async def fate(self) -> Fate | None:
        """The attempt's fate, or None while undecided."""
        return await read_fate(self.backend, self.where)

    async def claim(self, kind: str = COMMIT) -> Fate:
        """Decide the attempt's fate as ``kind`` (`COMMIT`, `ABANDON`, `COLLECT`) for this
        actor: `ckptstore.protocol.fates.claim`. `FencedError` if another decided first."""
        return await claim(self.backend, self.where, kind, self.owner)

    async def abandon(self) -> Fate:
        """Claim the attempt's fate as abandoned (this actor's own commit claim included)."""
        return await self.claim(ABANDON)

    async def clear(self, *, keep_fate: bool) -> int:
        """Delete everything below the attempt (its tombstone records, the fate and a
        deletion record, last, or not at all with ``keep_fate``: what a stalled writer of a
        collected attempt, or a promotion of a deleted step, finds). Only the winner of the
        attempt's fate (or ``delete_step``, for a committed one) calls this. Returns the
        number of objects removed."""
        groups: dict[str, list[str]] = defaultdict(list)
        async for info in self.backend.list(self.where.root):
            groups[info.key.removeprefix(self.where.root + "/").split("/")[0]].append(info.key)
        removed = 0
        for name, keys in sorted(groups.items()):
            key = f"{self.where.root}/{name}"
            if name in layout.TOMBSTONES:
                continue
            if keys == [key]:
                await self.backend.delete(key)
            else:
                await self.backend.delete_prefix(key)
            removed += len(keys)
        if not keep_fate:
            for name in layout.TOMBSTONES:
                if name in groups:
                    await self.backend.delete(f"{self.where.root}/{name}")
                    removed += 1
            # Only empty directories are left: pruned, never deleted blindly (once the records
            # are gone a promotion may claim the attempt afresh and copy a holder into it).
            await supports.prune_dirs(self.backend, self.where.root)
        return removed

    async def commit(self, manifest: Manifest, fate: Fate) -> Marker:
        """Write the attempt's manifest, then create the marker: the step is committed
        after this.

        ``fate`` is this actor's won `claim` of the attempt for its commit. Raises
        `AlreadyExistsError` if another attempt committed the step first; this attempt is
        then left as it is (garbage for `gc`), and the winner is untouched.
        """
        where, backend = self.where, self.backend
        if (manifest.step, manifest.attempt) != (where.step, where.attempt):
            raise ValueError(
                f"the manifest of step {manifest.step} attempt {manifest.attempt} "
                f"is not {where.root}'s"
            )
        if fate.kind != COMMIT:
            raise ValueError(f"commit needs the attempt claimed for its commit, not {fate.kind}")

        def encoded() -> bytes:
            data = manifest.to_bytes()
            # What a reader would refuse is never committed (a hand-edited part record, say).
            Manifest.from_bytes(data, where=f"{backend.url}/{where.manifest} (not written)")
            return data

        async def written() -> bytes | None:
            # Milliseconds per few hundred leaves: on a worker thread, never holding the loop.
            data = await off_loop(encoded, THREAD_BYTES)
            await backend.write(where.manifest, data)
            if manifest.base is not None:  # after the manifest is visible: docs/incremental.md
                await check_base(backend, manifest.base)
            return data

        # Every directory the attempt created is made durable before the marker, while the
        # manifest is encoded, written (its own directory with it) and the base checked; the
        # step's markers are listed meanwhile, for the marker's index (`create_marker`).
        try:
            got = await gather_first_error(
                [
                    written(),
                    supports.sync_dirs(backend, where.root),
                    step_records(backend, manifest.step),
                ]
            )
        except BaseStepGoneError:
            await self._give_up()
            raise
        data, records = got[0], got[2]
        assert isinstance(data, bytes) and isinstance(records, StepRecords)
        fate.check_fresh(where)
        manifest_digest = digest(data)
        marker = Marker(
            step=manifest.step,
            attempt=manifest.attempt,
            manifest_digest=manifest_digest,
            token=secrets.token_hex(16),
            time=time.time(),
            format_version=manifest.format_version,
        )
        try:
            index = await create_marker(backend, manifest.step, marker.to_bytes(), records)
        except AlreadyExistsError as exc:
            raise AlreadyExistsError(
                f"{exc.message}; attempt {manifest.attempt} was not committed",
                backend=backend.url,
                key=exc.key,
            ) from exc
        RECENT.add(manifest, manifest_digest, len(data))
        return dataclasses.replace(marker, index=index)

    async def _give_up(self) -> None:
        """An incremental save whose base went: abandon its own attempt (a dead attempt's
        references keep nothing alive) and remove what it wrote, its tombstone left for gc."""
        try:
            await self.abandon()
            await self.clear(keep_fate=True)
        except Exception:  # the base's error is the one to raise; gc removes the rest
            pass


async def check_base(backend: Backend, base: Reference) -> None:
    """`BaseStepGoneError` unless the base an incremental save names is still committed:
    no ``DELETED`` record in its attempt (read first), then its step's marker still naming
    it. Called after the referencing manifest is written and before its marker: a
    deletion that had not begun by the first read sees that manifest when it looks for
    references, so it keeps what the manifest references (docs/incremental.md)."""
    where = base.dir
    if await backend.exists(where.deleted):
        raise BaseStepGoneError(
            f"base step {where.step} was deleted while this save referenced it; not committed",
            backend=backend.url,
            key=where.deleted,
        )
    marker = await read_marker(backend, where.step)
    if marker is None or marker.attempt != where.attempt:
        raise BaseStepGoneError(
            f"base step {where.step} (attempt {where.attempt}) is no longer committed; "
            "this save was not committed",
            backend=backend.url,
            key=layout.commit_key(where.step),
        )
