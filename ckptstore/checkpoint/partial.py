"""Partial saves: build one checkpoint step from many parts, in O(total bytes).

A session is one attempt of the step (`ckptstore.protocol`): it records
itself in ``<step>/<attempt>/SESSION.json`` so that a resumer finds it. Each
`PartialSave.add` writes a *new* directory ``<attempt>/<item>/pending_<k>-<token>/``
holding per-process OCDBT stores, then records the part by creating
``<attempt>/<item>/parts/<k>.json`` last (create-if-absent: a part is complete
exactly when its record exists, and two writers can never both record part k).
Nothing already written is copied, renamed or deleted, on any backend.
`PartialSave.finalize` merges every recorded part by reference in one atomic
transaction, validates, and commits the step as a normal save does.

Reopening a session for the same step (after a crash) resumes the newest
uncommitted session of that step and item whose fate is undecided: its recorded
parts are kept, an unrecorded (interrupted) part is ignored and left for
`ckptstore.gc`.

Several actors may hold one session (a resumed job and its zombie, a finalize and an
abandon, gc). `finalize` and `abandon` first claim the attempt's fate
(`ckptstore.protocol.Attempt.claim`, one create-if-absent): the loser gets
`FencedError` before it writes anything, so a committed session is never rebuilt or
deleted under its readers. A finalize killed after its claim leaves the session
decided: resuming starts a new session (its parts go to gc).

Every part records the piece digests of what it wrote, so a finalized step can serve as a
later save's base. A session opened with ``base=B`` (a committed step, named once in
``SESSION.json``) is incremental like ``save(..., base=B)``: each `add` references the
leaves unchanged since B instead of writing them (`ckptstore.checkpoint.incremental`,
one agreement round per part), and `finalize` commits only if B is still committed
(`ckptstore.protocol.check_base`; docs/incremental.md).

A session has one item (the one it was opened for, named in ``SESSION.json``), and may
add parts to other items of the same step (``add(..., item=NAME)``) and JSON items at
`finalize`: all of them commit together or not at all (``import-orbax`` of an Orbax
Composite step). Part indices count across the session's items.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.engine import commit_step
from ckptstore.checkpoint.incremental import (
    Unchanged,
    open_base,
    read_digests,
    unchanged,
    write_digests,
)
from ckptstore.checkpoint.parts import (
    Joined,
    Part,
    SessionPlan,
    created,
    join_items,
    nesting_conflicts,
    read_session,
    session_base,
)
from ckptstore.checkpoint.save import PreparedItem, SaveResult
from ckptstore.datapath.arrays import write_store
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    DuplicateLeafError,
    FencedError,
    TreeError,
)
from ckptstore.format import layout
from ckptstore.format.casts import CastPolicy
from ckptstore.format.codecs import CodecPolicy
from ckptstore.format.jsonitems import JsonItem, as_json_item
from ckptstore.format.layout import AttemptDir
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import Reference
from ckptstore.format.packs import PackRef
from ckptstore.format.tree import check_structure
from ckptstore.protocol import Attempt, ensure_uncommitted, new_owner
from ckptstore.runtime import distributed
from ckptstore.runtime.handoff import Handoff

#: A process's report of a part: how many leaves it digested (`DIGESTS` beside its store).
_DIGESTED = "digested"


class PartialSave:
    """A partial-save session for one step; open it with `PartialSave.open`."""

    def __init__(
        self,
        backend: Backend,
        step: int,
        item: str,
        timeout: float,
        release: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.backend = backend
        self.step = step
        self.item = item
        self.timeout = timeout
        self.where = AttemptDir(step, None)  # set by `open`
        self.parts: list[Part] = []
        self._release = release  # what `close` calls: the opener's release of the backend
        self._done = ""  # "finalized" or "abandoned" once the session is over
        self._owner = new_owner()  # this session object's name in the attempt's fate record
        self._ending = ""  # "finalize" or "abandon" while one runs: the other is refused
        #: The session's base step (None: not incremental).
        self.base: Reference | None = None

    @property
    def attempt(self) -> str:
        """The attempt id this session writes below (pass it to `open` to resume exactly it)."""
        return str(self.where.attempt)

    @property
    def _attempt(self) -> Attempt:
        """The session's attempt, as this session object handles it (its fate's owner)."""
        return Attempt(self.backend, self.where, self._owner)

    # ---- life cycle ----

    @classmethod
    async def open(
        cls,
        backend: Backend,
        step: int,
        *,
        item: str = layout.DEFAULT_ITEM,
        timeout: float = distributed.DEFAULT_TIMEOUT,
        resume: bool = True,
        attempt: str | None = None,
        base: int | None = None,
        release: Callable[[], Awaitable[None]] | None = None,
    ) -> PartialSave:
        """Open the partial save of ``step`` on ``backend``.

        By default the newest uncommitted session of this step and item is resumed,
        or a new one started; ``resume=False`` always starts a new one, and
        ``attempt`` resumes exactly that session (`CheckpointNotFoundError` if absent).

        ``base`` (a committed step): parts reference the leaves unchanged since it rather
        than write them (the module docstring). A new session reads it at once
        (`BaseStepGoneError` if it is not committed) and records it; a resumed session
        must have been opened with the same base (`ConfigError` otherwise).

        ``release``: called once by `close` (and here, if opening fails), so the opener of
        ``backend`` (`ckptstore.partial_save`) hands its closing to the session.
        """
        session = cls(backend, step, item, timeout, release)  # `close` releases the backend
        try:
            session.step = layout.check_step(step)
            if base is not None:
                base = layout.check_step(base)
            layout.check_item(item)
            await session._start(resume, attempt, base)
        except BaseException:
            await session.close()
            raise
        return session

    async def close(self) -> None:
        """Release the backend if the session was handed its release. Parts stay for a
        later resume."""
        if self._release is not None:
            release, self._release = self._release, None
            await release()

    async def __aenter__(self) -> PartialSave:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _start(self, resume: bool, attempt: str | None, base: int | None) -> None:
        await ensure_uncommitted(self.backend, self.step)
        handoff = Handoff(f"partial/{self.step}/open", self.timeout)
        chosen = json.loads(await handoff.agree(lambda: self._choose(resume, attempt, base)))
        self.where = AttemptDir(self.step, chosen["attempt"])
        self.base = None if chosen["base"] is None else Reference.from_json(chosen["base"], "base")
        self.parts = await self._load_parts()

    async def _choose(self, resume: bool, attempt: str | None, base: int | None) -> str:
        """On process 0: the attempt this session writes below, and its base (JSON)."""
        if attempt is not None:
            record = await self._session(attempt) if layout.is_attempt(attempt) else None
            if record is None:
                raise CheckpointNotFoundError(
                    f"no partial-save session {attempt!r} of item {self.item!r}",
                    backend=self.backend.url,
                    key=layout.step_dir(self.step),
                )
            await self._check_undecided(AttemptDir(self.step, attempt))
            return json.dumps(session_base(record, AttemptDir(self.step, attempt), base))
        if resume:
            names = await self.backend.list_dir(layout.step_dir(self.step))
            found = [(await self._session(n), n) for n in names if layout.is_attempt(n)]
            sessions = [
                (created(record), n, record)
                for record, n in found
                if record is not None and await self._undecided(n)
            ]
            if sessions:
                _, newest, record = max(sessions, key=lambda s: (s[0], s[1]))
                return json.dumps(session_base(record, AttemptDir(self.step, newest), base))
        based = (await open_base(self.backend, base)).ref if base is not None else None
        fresh = layout.new_attempt()
        record = {"step": self.step, "attempt": fresh, "item": self.item, "created": time.time()}
        if based is not None:
            record["base"] = based.to_json()
        await self.backend.create(AttemptDir(self.step, fresh).session, json.dumps(record).encode())
        return json.dumps({"attempt": fresh, "base": None if based is None else based.to_json()})

    async def _undecided(self, attempt: str) -> bool:
        return await Attempt(self.backend, AttemptDir(self.step, attempt)).fate() is None

    async def _session(self, attempt: str) -> dict[str, Any] | None:
        """The session record of this item for ``attempt``; None if there is none."""
        return await read_session(self.backend, AttemptDir(self.step, attempt), self.item)

    async def _load_parts(self) -> list[Part]:
        """Every item's recorded parts, in index order."""
        names = [n for n in await self.backend.list_dir(self.where.root) if layout.is_item(n)]
        parts = []
        for item in {self.item, *names}:
            prefix = self.where.parts(item)
            for name in await self.backend.list_dir(prefix):
                if name.endswith(".json"):
                    key = f"{prefix}/{name}"
                    parts.append(Part.from_bytes(await self.backend.read(key), key, item))
        return sorted(parts, key=lambda p: p.index)

    def _check_open(self) -> None:
        if self._done:
            raise CkptStoreError(f"the partial save of step {self.step} is already {self._done}")
        if self._ending:
            raise CkptStoreError(f"the partial save of step {self.step} is in its {self._ending}")

    async def _check_undecided(self, where: AttemptDir | None = None) -> None:
        """`FencedError` if another actor already decided the session's fate (an early
        refusal: what decides is `claim`)."""
        where = where or self.where
        fate = await Attempt(self.backend, where).fate()
        if fate is not None and fate.owner != self._owner:
            raise FencedError(
                f"partial-save session {where.attempt} of step {self.step} was already "
                f"{fate.describe()}",
                backend=self.backend.url,
                key=where.fate,
            )

    # ---- parts ----

    @property
    def leaves(self) -> dict[str, LeafInfo]:
        """Every leaf of the session's item saved so far (a later part's version of a
        replaced leaf)."""
        return self.leaves_of(self.item)

    def leaves_of(self, item: str) -> dict[str, LeafInfo]:
        """`leaves`, of another item the session added parts to."""
        out: dict[str, LeafInfo] = {}
        for part in self.parts:
            if part.item == item:
                out.update(part.leaves)
        return out

    async def add(
        self,
        subtree: Any,
        *,
        replace: bool = False,
        item: str | None = None,
        codecs: Any = None,
        casts: Any = None,
    ) -> Part:
        """Write ``subtree`` as a new part of ``item`` (default: the session's item);
        returns once the part is durable and recorded. ``codecs``: which of its leaves are
        compressed; ``casts``: which are stored in a narrower dtype (lossy, never unless
        asked); both as `ckptstore.save` takes them.

        Refused before anything is written: a leaf an earlier part of the item holds
        (unless ``replace``), and a leaf that lies under, or above, a leaf of an earlier
        part. In a session with a base, a leaf unchanged since the base is referenced, not
        written (`Part.refs`); `BaseStepGoneError`, nothing written, if the base is no
        longer committed as the attempt the session recorded.
        """
        self._check_open()
        item = layout.check_item(item if item is not None else self.item)
        prepared = self._prepare_part(subtree, item, replace, codecs, casts)
        infos = prepared.leaves
        index = max((p.index for p in self.parts), default=-1) + 1  # same on every process
        handoff = Handoff(f"partial/{self.step}/add/{index}", self.timeout)
        await self._check_undecided()
        values = [value for _, value in prepared.named]
        same = await self._unchanged_since_base(item, infos, values, handoff)

        async def name_part() -> str:
            return layout.new_part_name(index)

        part_dir = await handoff.agree(name_part)
        await handoff.everyone(
            lambda: self._write_part(handoff, item, part_dir, infos, values, same)
        )
        refs, packed = _base_references(same, item)
        part = Part(
            index=index,
            dir=part_dir,
            leaves={info.name: info for info in infos},
            structure=prepared.structure,
            replace=replace,
            processes=[],
            refs=refs,
            packed=packed,
            item=item,
        )
        part = await handoff.primary(lambda: self._record_part(handoff, part, same)) or part
        self.parts.append(part)
        return part

    def _prepare_part(
        self, subtree: Any, item: str, replace: bool, codecs: Any, casts: Any
    ) -> PreparedItem:
        """``subtree`` prepared as a save prepares an item, and checked against the item's
        earlier parts: all before anything is written, so a refused part leaves no trace.

        Bad codecs or casts fail in the preparation; a leaf nested under (or above) a leaf
        of an earlier part is a `TreeError`, and one an earlier part holds a
        `DuplicateLeafError` unless ``replace``."""
        prepared = PreparedItem.of(subtree, CodecPolicy.of(codecs), CastPolicy.of(casts))
        infos = prepared.leaves
        saved = self.leaves_of(item)
        nested = nesting_conflicts(set(saved), [info.name for info in infos])
        if nested:
            raise TreeError("a part cannot nest leaves inside earlier ones: " + "; ".join(nested))
        if not replace:
            taken = sorted(set(saved) & {info.name for info in infos})
            if taken:
                raise DuplicateLeafError(taken)
        return prepared

    async def _unchanged_since_base(
        self, item: str, infos: list[LeafInfo], values: list[Any], handoff: Handoff
    ) -> Unchanged:
        """The part's leaves unchanged since the session's base (none without a base).

        With a base, every process digests its pieces and all agree in one round of
        ``handoff`` (whole leaves only: a part references a leaf or writes all of it)."""
        if self.base is None:
            return Unchanged({item: set()}, {})
        pairs = {item: (infos, values)}
        base = self.base
        return await unchanged(
            self.backend, base.step, pairs, handoff, attempt=base.attempt, whole_only=True
        )

    async def _write_part(
        self,
        handoff: Handoff,
        item: str,
        part_dir: str,
        infos: list[LeafInfo],
        values: list[Any],
        same: Unchanged,
    ) -> dict[str, Any]:
        """Every process: write its pieces of the leaves not referenced from the base into
        its own store of the part, then the piece digests beside it. Returns the process's
        report: its write stats and how many leaves it digested (`_DIGESTED`)."""
        held = same.leaves[item]
        store = self.where.part_store(item, part_dir, handoff.me)
        digests = dict(same.digested.get(item, {}))
        stats = await write_store(
            self.backend,
            store,
            [(i, v) for i, v in zip(infos, values, strict=True) if i.name not in held],
            process=handoff.me,
            write_metadata=handoff.me == 0,
            digests=digests,
        )
        digested = await write_digests(self.backend, store, digests)
        return {**stats.to_json(), _DIGESTED: digested}

    async def _record_part(self, handoff: Handoff, part: Part, same: Unchanged) -> Part:
        """On process 0, once every process wrote: the part with the processes' reports and
        the leaves' digests, recorded by creating its record (create-if-absent, last: the
        part exists exactly when its record does).

        `AlreadyExistsError` if another writer of the session recorded this index first;
        `FencedError` if another actor decided the session meanwhile (a part recorded
        after that is not in its step)."""
        item, held = part.item, same.leaves[part.item]
        reports = await handoff.reports()
        stores = [
            self.where.part_store(item, part.dir, i)
            for i, report in enumerate(reports)
            if report.get(_DIGESTED)
        ]
        digests = await read_digests(self.backend, stores)
        for leaf in held:  # a referenced leaf's digests are the base's
            assert same.base is not None
            digests[leaf] = same.base.digests(item, leaf)
        recorded = dataclasses.replace(
            part,
            processes=[{k: v for k, v in r.items() if k != _DIGESTED} for r in reports],
            digests={leaf: digests[leaf] for leaf in part.leaves if leaf in digests},
        )
        key = self.where.part_record(item, part.index)
        try:
            await self.backend.create(key, recorded.to_bytes())
        except AlreadyExistsError as exc:
            raise AlreadyExistsError(
                f"another writer of session {self.attempt} recorded part {part.index} first; "
                "reopen the session to continue",
                backend=self.backend.url,
                key=key,
            ) from exc
        # A part recorded after another actor decided the session is not in its step.
        await self._check_undecided()
        return recorded

    async def drop(self, index: int) -> None:
        """Remove part ``index`` from the session (its data is left for `ckptstore.gc`)."""
        self._check_open()
        matching = [p for p in self.parts if p.index == index]
        if not matching:
            raise CkptStoreError(
                f"the partial save of step {self.step} has no part {index} "
                f"(it has {[p.index for p in self.parts]})"
            )
        handoff = Handoff(f"partial/{self.step}/drop/{index}", self.timeout)

        async def unrecord() -> None:
            await self._check_undecided()
            await self.backend.delete(self.where.part_record(matching[0].item, index))

        await handoff.primary(unrecord)
        self.parts.remove(matching[0])

    async def abandon(self) -> None:
        """Delete this session's attempt, every part included; the step stays uncommitted.

        Claims the session's fate first: if another actor finalized (or collected) it,
        `FencedError` and nothing is deleted. The fate record stays as a tombstone
        (`ckptstore.gc` removes it a day later), so a zombie of the session cannot
        commit it afterwards."""
        self._check_open()
        handoff = Handoff(f"partial/{self.step}/abandon", self.timeout)

        async def drop_all() -> None:
            await self._attempt.abandon()
            await self._attempt.clear(keep_fate=True)

        self._ending = "abandon"  # before the first await: a finalize of this object waits
        try:
            await ensure_uncommitted(self.backend, self.step)
            await handoff.primary(drop_all)
        finally:
            self._ending = ""
        self._done = "abandoned"
        self.parts = []
        await self.close()

    async def finalize(
        self,
        *,
        metadata: dict[str, Any] | None = None,
        structure: dict[str, Any] | None = None,
        structures: Mapping[str, dict[str, Any]] | None = None,
        json_items: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """Merge every part by reference, validate, and commit the step: every item the
        session added parts to, and ``json_items``, together or not at all.

        Claims the session's fate first: if another actor (a zombie's finalize, an
        abandon, gc) decided it, `FencedError` before anything is written.
        ``structure`` (`ckptstore.format.tree` format) replaces the one the parts'
        subtrees describe, so lists and tuples can span parts (the parts merge as
        dicts); it must name exactly the session's leaves. ``structures``: the same for
        any item, by name. ``json_items``: configuration items (JSON values, dataclasses,
        or `JsonItem`s) kept as JSON in the manifest, as `save_items` keeps them. Raises
        `AlreadyExistsError` if another attempt committed the step meanwhile; in a session
        with a base, `BaseStepGoneError` (nothing committed) if a leaf it kept is
        referenced and the base is no longer committed (`protocol.check_base`).
        """
        self._check_open()
        given = {**(structures or {}), **({self.item: structure} if structure else {})}
        configs = {layout.check_item(n): as_json_item(n, v) for n, v in (json_items or {}).items()}
        items = sorted({part.item for part in self.parts})
        if not items and not configs:
            raise CkptStoreError(f"step {self.step}: nothing to finalize (no parts were added)")
        if set(items) & set(configs):
            raise TreeError(f"items {sorted(set(items) & set(configs))} are parts and JSON items")
        for name, tree in given.items():
            if name not in items:
                raise TreeError(f"a structure was given for item {name!r}, which has no parts")
            if check_structure(tree) != set(self.leaves_of(name)):
                raise TreeError(
                    f"the structure given to finalize for item {name!r} does not name its "
                    "parts' leaves"
                )
        start = time.perf_counter()
        handoff = Handoff(f"partial/{self.step}/finalize", self.timeout)
        self._ending = "finalize"
        try:
            merge_seconds = await handoff.primary(
                lambda: self._merge_and_commit(metadata, given, configs)
            )
        finally:
            self._ending = ""
        self._done = "finalized"
        joined = self._joined()
        await self.close()
        return SaveResult(
            step=self.step,
            attempt=self.attempt,
            bytes=sum(i.nbytes for j in joined.values() for i in j.leaves.values()),
            bytes_written=sum(part.bytes_written for part in self.parts),
            seconds=time.perf_counter() - start,
            merge_seconds=merge_seconds or 0.0,
            bytes_referenced=sum(j.leaves[leaf].nbytes for j in joined.values() for leaf in j.held),
        )

    def _joined(self) -> dict[str, Joined]:
        return join_items(self.parts, self.where)

    async def _merge_and_commit(
        self,
        metadata: dict[str, Any] | None,
        given: dict[str, dict[str, Any]],
        configs: dict[str, JsonItem],
    ) -> float:
        await ensure_uncommitted(self.backend, self.step)
        plan = SessionPlan(
            self.backend, self.where, self.base, self.parts, metadata or {}, given, configs
        )
        await commit_step(self._attempt, plan)
        return plan.seconds


def _base_references(same: Unchanged, item: str) -> tuple[dict[str, Reference], dict[str, PackRef]]:
    """Where each leaf of ``item`` unchanged since the base is read from: the base's holder
    of its bytes (always the holder, so references never chain), and its pack when the
    base packed it."""
    refs: dict[str, Reference] = {}
    packed: dict[str, PackRef] = {}
    for leaf in sorted(same.leaves[item]):
        assert same.base is not None
        refs[leaf] = same.base.holder(item, leaf)
        if (ref := same.base.packed(item, leaf)) is not None:
            packed[leaf] = ref
    return refs, packed
