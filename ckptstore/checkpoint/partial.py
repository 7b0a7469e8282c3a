"""Partial saves: build one checkpoint step from many parts, in O(total bytes).

A session is one attempt of the step (`ckptstore.checkpoint.commit`): it records
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
(`ckptstore.checkpoint.commit.claim`, one create-if-absent): the loser gets
`FencedError` before it writes anything, so a committed session is never rebuilt or
deleted under its readers. A finalize killed after its claim leaves the session
decided: resuming starts a new session (its parts go to gc).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.commit import (
    ABANDON,
    COMMIT,
    claim,
    clear_attempt,
    commit,
    ensure_uncommitted,
    new_owner,
    read_fate,
)
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.save import SaveResult
from ckptstore.checkpoint.target import Target, opened
from ckptstore.datapath.arrays import ocdbt_spec, write_leaves
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    CorruptCheckpointError,
    FencedError,
    NotFoundError,
    TreeError,
)
from ckptstore.errors import DuplicateLeafError as DuplicateLeafError  # old home re-exports it
from ckptstore.format import layout
from ckptstore.format.layout import AttemptDir
from ckptstore.format.leaves import LeafInfo, describe_leaf, storable
from ckptstore.format.manifest import ItemManifest, Manifest, parse_leaf
from ckptstore.format.tree import check_leaf_paths, check_structure, describe, flatten
from ckptstore.runtime import distributed
from ckptstore.runtime.handoff import Handoff

_PART_DIR = re.compile(r"pending_([0-9]+)-[0-9a-f]{8}")


@dataclass(frozen=True, repr=False)
class Part:
    """One completed part of a partial save (its repr is one short line: the leaves and
    structure it carries can be thousands of entries)."""

    index: int
    dir: str  # the part's directory below the item, ``pending_<index>-<token>``
    leaves: dict[str, LeafInfo]
    structure: dict[str, Any]
    replace: bool
    processes: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.leaves.values())

    def __repr__(self) -> str:
        leaves = (
            f"{len(self.leaves)} leaf" if len(self.leaves) == 1 else f"{len(self.leaves)} leaves"
        )
        replace = ", replace" if self.replace else ""
        return f"<Part {self.index} {self.dir}: {leaves}, {self.nbytes} bytes{replace}>"

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "index": self.index,
                "dir": self.dir,
                "replace": self.replace,
                "structure": self.structure,
                "processes": self.processes,
                "leaves": {n: info.to_json() for n, info in self.leaves.items()},
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Part:
        """A part record, checked as strictly as a manifest (its leaves and structure go
        into one when the session is finalized)."""
        try:
            doc = json.loads(data)
            index, name = doc["index"], doc["dir"]
            match = _PART_DIR.fullmatch(name) if isinstance(name, str) else None
            if type(index) is not int or match is None or int(match[1]) != index:
                raise ValueError(f"part {index!r} names directory {name!r}")
            leaves = {n: parse_leaf(n, d) for n, d in doc["leaves"].items()}
            if check_structure(doc["structure"]) != set(leaves):
                raise ValueError("its structure and its leaves name different leaves")
            check_leaf_paths(doc["structure"])
            processes = doc["processes"]
            if not isinstance(processes, list) or any(
                not isinstance(p, dict) or p.get("process") != i for i, p in enumerate(processes)
            ):
                raise ValueError("its processes are not the reports of processes 0, 1, ...")
            return cls(
                index=index,
                dir=name,
                leaves=leaves,
                structure=doc["structure"],
                replace=bool(doc["replace"]),
                processes=processes,
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable part record {where}: {exc}") from exc


def merge_structures(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Overlay one tree description on another: dicts merge key by key, else ``extra`` wins."""
    if base.get("t") != "dict" or extra.get("t") != "dict":
        return extra
    keys = [tuple(k) for k in base["keys"]]
    items = list(base["items"])
    for key, item in zip(extra["keys"], extra["items"], strict=True):
        key = tuple(key)
        if key in keys:
            i = keys.index(key)
            items[i] = merge_structures(items[i], item)
        else:
            keys.append(key)
            items.append(item)
    return {"t": "dict", "keys": [list(k) for k in keys], "items": items}


class PartialSave:
    """A partial-save session for one step; open it with `PartialSave.open`."""

    def __init__(
        self, backend: Backend, step: int, item: str, timeout: float, owned: Any = None
    ) -> None:
        self.backend = backend
        self.step = step
        self.item = item
        self.timeout = timeout
        self.where = AttemptDir(step, None)  # set by `open`
        self.parts: list[Part] = []
        self._owned = owned  # the context manager that opened the backend, if we did
        self._done = ""  # "finalized" or "abandoned" once the session is over
        self._owner = new_owner()  # this session object's name in the attempt's fate record
        self._ending = ""  # "finalize" or "abandon" while one runs: the other is refused

    @property
    def attempt(self) -> str:
        """The attempt id this session writes below (pass it to `open` to resume exactly it)."""
        return str(self.where.attempt)

    # ---- life cycle ----

    @classmethod
    async def open(
        cls,
        target: Target,
        step: int,
        *,
        item: str = layout.DEFAULT_ITEM,
        timeout: float = distributed.DEFAULT_TIMEOUT,
        resume: bool = True,
        attempt: str | None = None,
        check: Callable[[Backend, int, float], Awaitable[None]] | None = None,
    ) -> PartialSave:
        """Open the partial save of ``step``.

        By default the newest uncommitted session of this step and item is resumed,
        or a new one started; ``resume=False`` always starts a new one, and
        ``attempt`` resumes exactly that session (`CheckpointNotFoundError` if absent).
        ``check(backend, step, timeout)``, if given, runs first (tiers: `refuse_host_local`).
        """
        step = layout.check_step(step)
        layout.check_item(item)
        if isinstance(target, Backend):
            session = cls(target, step, item, timeout)
        else:
            owned = opened(target)
            session = cls(await owned.__aenter__(), step, item, timeout, owned)
        try:
            if check is not None:
                await check(session.backend, step, timeout)
            await session._start(resume, attempt)
        except BaseException:
            await session.close()
            raise
        return session

    async def close(self) -> None:
        """Release the backend if the session opened it. Parts stay for a later resume."""
        if self._owned is not None:
            owned, self._owned = self._owned, None
            await owned.__aexit__(None, None, None)

    async def __aenter__(self) -> PartialSave:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _start(self, resume: bool, attempt: str | None) -> None:
        await ensure_uncommitted(self.backend, self.step)
        handoff = Handoff(f"partial/{self.step}/open", self.timeout)
        chosen = await handoff.agree(lambda: self._choose(resume, attempt))
        self.where = AttemptDir(self.step, chosen)
        self.parts = await self._load_parts()

    async def _choose(self, resume: bool, attempt: str | None) -> str:
        """On process 0: the attempt this session writes below."""
        if attempt is not None:
            if not layout.is_attempt(attempt) or await self._session_created(attempt) is None:
                raise CheckpointNotFoundError(
                    f"no partial-save session {attempt!r} of item {self.item!r}",
                    backend=self.backend.url,
                    key=layout.step_dir(self.step),
                )
            await self._check_undecided(AttemptDir(self.step, attempt))
            return attempt
        if resume:
            names = await self.backend.list_dir(layout.step_dir(self.step))
            found = [(await self._session_created(n), n) for n in names if layout.is_attempt(n)]
            sessions = [
                (created, n)
                for created, n in found
                if created is not None and await self._undecided(n)
            ]
            if sessions:
                return max(sessions)[1]  # the newest
        fresh = layout.new_attempt()
        record = {"step": self.step, "attempt": fresh, "item": self.item, "created": time.time()}
        await self.backend.create(AttemptDir(self.step, fresh).session, json.dumps(record).encode())
        return fresh

    async def _undecided(self, attempt: str) -> bool:
        return await read_fate(self.backend, AttemptDir(self.step, attempt)) is None

    async def _session_created(self, attempt: str) -> float | None:
        """When the session of this item recorded for ``attempt`` began; None if there is none."""
        key = AttemptDir(self.step, attempt).session
        try:
            record = json.loads(await self.backend.read(key))
        except NotFoundError:
            return None
        except (ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable session record {key}: {exc}") from exc
        if not isinstance(record, dict) or record.get("item") != self.item:
            return None
        created = record.get("created")
        return float(created) if isinstance(created, (int, float)) else 0.0

    async def _load_parts(self) -> list[Part]:
        prefix = self.where.parts(self.item)
        parts = []
        for name in await self.backend.list_dir(prefix):
            if name.endswith(".json"):
                key = f"{prefix}/{name}"
                parts.append(Part.from_bytes(await self.backend.read(key), key))
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
        fate = await read_fate(self.backend, where)
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
        """Every leaf saved so far (a later part's version of a replaced leaf)."""
        out: dict[str, LeafInfo] = {}
        for part in self.parts:
            out.update(part.leaves)
        return out

    async def add(self, subtree: Any, *, replace: bool = False) -> Part:
        """Write ``subtree`` as a new part; returns once the part is durable and recorded.

        Refused before anything is written: a leaf an earlier part holds (unless
        ``replace``), and a leaf that lies under, or above, a leaf of an earlier part.
        """
        self._check_open()
        named = flatten(subtree)
        infos = [describe_leaf(name, value) for name, value in named]
        if any(info.prng_impl for info in infos):  # typed PRNG keys: write their data
            named = [(name, storable(value)) for name, value in named]
        saved = self.leaves
        nested = _nesting_conflicts(set(saved), [info.name for info in infos])
        if nested:
            raise TreeError("a part cannot nest leaves inside earlier ones: " + "; ".join(nested))
        if not replace:
            taken = sorted(set(saved) & {info.name for info in infos})
            if taken:
                raise DuplicateLeafError(taken)
        index = self.parts[-1].index + 1 if self.parts else 0  # same on every process
        handoff = Handoff(f"partial/{self.step}/add/{index}", self.timeout)
        await self._check_undecided()

        async def name_part() -> str:
            return layout.new_part_name(index)

        part_dir = await handoff.agree(name_part)

        async def write_mine() -> dict[str, Any]:
            store = self.where.part_store(self.item, part_dir, handoff.me)
            with self.backend.write_behind(store):
                stats = await write_leaves(
                    ocdbt_spec(self.backend.kvstore_spec(store)),
                    self.backend.ts_context,
                    list(zip(infos, (value for _, value in named), strict=True)),
                    process=handoff.me,
                    write_metadata=handoff.me == 0,
                )
            return stats.to_json()

        await handoff.everyone(write_mine)
        part = Part(
            index=index,
            dir=part_dir,
            leaves={info.name: info for info in infos},
            structure=describe(subtree),
            replace=replace,
            processes=[],
        )

        async def record() -> Part:
            recorded = dataclasses.replace(part, processes=await handoff.reports())
            key = self.where.part_record(self.item, index)
            try:
                await self.backend.create(key, recorded.to_bytes())
            except AlreadyExistsError as exc:
                raise AlreadyExistsError(
                    f"another writer of session {self.attempt} recorded part {index} first; "
                    "reopen the session to continue",
                    backend=self.backend.url,
                    key=key,
                ) from exc
            # A part recorded after another actor decided the session is not in its step.
            await self._check_undecided()
            return recorded

        part = await handoff.primary(record) or part
        self.parts.append(part)
        return part

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
            await self.backend.delete(self.where.part_record(self.item, index))

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
            await claim(self.backend, self.where, ABANDON, self._owner)
            await clear_attempt(self.backend, self.where, keep_fate=True)

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
        self, *, metadata: dict[str, Any] | None = None, structure: dict[str, Any] | None = None
    ) -> SaveResult:
        """Merge every part by reference, validate, and commit the step.

        Claims the session's fate first: if another actor (a zombie's finalize, an
        abandon, gc) decided it, `FencedError` before anything is written.
        ``structure`` (`ckptstore.format.tree` format) replaces the one the parts'
        subtrees describe, so lists and tuples can span parts (the parts merge as
        dicts); it must name exactly the session's leaves. Raises `AlreadyExistsError`
        if another attempt committed the step meanwhile.
        """
        self._check_open()
        if not self.parts:
            raise CkptStoreError(f"step {self.step}: nothing to finalize (no parts were added)")
        if structure is not None and check_structure(structure) != set(self.leaves):
            raise TreeError("the structure given to finalize does not name the parts' leaves")
        start = time.perf_counter()
        handoff = Handoff(f"partial/{self.step}/finalize", self.timeout)
        self._ending = "finalize"
        try:
            merge_seconds = await handoff.primary(
                lambda: self._merge_and_commit(metadata, structure)
            )
        finally:
            self._ending = ""
        self._done = "finalized"
        leaves = self.leaves
        await self.close()
        return SaveResult(
            step=self.step,
            attempt=self.attempt,
            bytes=sum(info.nbytes for info in leaves.values()),
            bytes_written=sum(part.nbytes for part in self.parts),
            seconds=time.perf_counter() - start,
            merge_seconds=merge_seconds or 0.0,
        )

    async def _merge_and_commit(
        self, metadata: dict[str, Any] | None, given: dict[str, Any] | None
    ) -> float:
        await ensure_uncommitted(self.backend, self.step)
        fate = await claim(self.backend, self.where, COMMIT, self._owner)
        item, where = self.item, self.where
        stores: list[str] = []
        clear: dict[str, list[str]] = {}
        seen: set[str] = set()
        structure: dict[str, Any] = {"t": "dict", "keys": [], "items": []}
        processes: list[dict[str, Any]] = []
        for part in self.parts:
            replaced = sorted(seen & set(part.leaves))
            part_stores = [where.part_store(item, part.dir, p) for p in range(_writers(part))]
            if replaced:
                clear[part_stores[0]] = replaced
            stores += part_stores
            seen |= set(part.leaves)
            structure = merge_structures(structure, part.structure)
            processes += [{"part": part.index, **p} for p in part.processes]
        structure = given or structure
        leaves = self.leaves
        merged = await merge(self.backend, where.item(item), stores, list(leaves.values()), clear)
        manifest = Manifest(
            step=self.step,
            attempt=where.attempt,
            items={
                item: ItemManifest(
                    structure=structure,
                    leaves=leaves,
                    parts=[s.removeprefix(where.item(item) + "/") for s in stores],
                )
            },
            processes=processes,
            metadata=metadata or {},
        )
        await commit(self.backend, manifest, fate)
        return merged.seconds


def _nesting_conflicts(saved: set[str], new: list[str]) -> list[str]:
    """New leaf names that lie under a saved leaf, or above one (a saved leaf lies under them)."""
    above = {name.rsplit("/", i)[0] for name in saved for i in range(1, name.count("/") + 1)}
    problems = []
    for name in new:
        parents = ["/".join(name.split("/")[:i]) for i in range(1, name.count("/") + 1)]
        under = [p for p in parents if p in saved]
        if under:
            problems.append(f"{name!r} lies under the saved leaf {under[0]!r}")
        elif name in above:
            problems.append(f"{name!r} holds leaves an earlier part saved below it")
    return problems


def _writers(part: Part) -> int:
    """How many processes wrote ``part`` (each has its own store)."""
    return max(1, len(part.processes))
