"""The parts of a partial save (`ckptstore.checkpoint.partial`): their records, how a
finalize joins them into one item, and its plan for the commit engine (`SessionPlan`).

A part's record (``<attempt>/<item>/parts/<k>.json``) lists the leaves the part carries.
Each is either written by the part (into its per-process stores) or, in a session with a
base step (``partial_save(..., base=B)``), referenced: held by the attempt that holds B's
bytes of it, never a chain (docs/incremental.md). The record also keeps every leaf's piece
digests (`ckptstore.format.digests`), so the finalized step can serve as a later save's base.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.incremental import References
from ckptstore.checkpoint.merge import merge
from ckptstore.errors import ConfigError, CorruptCheckpointError, NotFoundError
from ckptstore.format.digests import PieceTable, check_table
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.layout import DEFAULT_ITEM, AttemptDir
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import (
    ItemManifest,
    Manifest,
    Reference,
    is_attempt_ref,
    needed_version,
    parse_leaf,
)
from ckptstore.format.packs import PackRef
from ckptstore.format.tree import check_leaf_paths, check_structure

PART_DIR = re.compile(r"pending_([0-9]+)-[0-9a-f]{8}")


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
    #: Leaves the part did not write because the session's base holds them: leaf -> the
    #: attempt holding the bytes.
    refs: dict[str, Reference] = field(default_factory=dict)
    #: Of those, the ones packed in their holder's item (`ckptstore.format.packs`).
    packed: dict[str, PackRef] = field(default_factory=dict)
    #: Every leaf's piece digests (absent in records written before digests were kept).
    digests: dict[str, PieceTable] = field(default_factory=dict)
    #: The item the part belongs to: where its record lies (``<attempt>/<item>/parts/``),
    #: so it is not written into the record.
    item: str = DEFAULT_ITEM

    @property
    def nbytes(self) -> int:
        """Payload bytes of the part's leaves, referenced ones included."""
        return sum(info.nbytes for info in self.leaves.values())

    @property
    def bytes_written(self) -> int:
        """Payload bytes the part wrote (its leaves less the referenced ones)."""
        return sum(info.nbytes for name, info in self.leaves.items() if name not in self.refs)

    def __repr__(self) -> str:
        leaves = (
            f"{len(self.leaves)} leaf" if len(self.leaves) == 1 else f"{len(self.leaves)} leaves"
        )
        replace = ", replace" if self.replace else ""
        held = f", {len(self.refs)} referenced" if self.refs else ""
        return f"<Part {self.index} {self.dir}: {leaves}, {self.nbytes} bytes{held}{replace}>"

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "index": self.index,
                "dir": self.dir,
                "replace": self.replace,
                "structure": self.structure,
                "processes": self.processes,
                "leaves": {n: info.to_json() for n, info in self.leaves.items()},
                "refs": {n: ref.to_json() for n, ref in self.refs.items()},
                "packed": {n: ref.to_json() for n, ref in self.packed.items()},
                "digests": self.digests,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str, item: str = DEFAULT_ITEM) -> Part:
        """A part record of ``item``, checked as strictly as a manifest (its leaves and
        structure go into one when the session is finalized)."""
        try:
            doc = json.loads(data)
            index, name = doc["index"], doc["dir"]
            match = PART_DIR.fullmatch(name) if isinstance(name, str) else None
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
            refs = doc.get("refs", {})
            if not isinstance(refs, dict) or not all(is_attempt_ref(r) for r in refs.values()):
                raise ValueError("its refs are not attempts")
            packed = {n: PackRef.from_json(n, r) for n, r in doc.get("packed", {}).items()}
            digests = {n: check_table(n, t) for n, t in doc.get("digests", {}).items()}
            if not set(packed) <= set(refs) or not set(refs) | set(digests) <= set(leaves):
                raise ValueError("its refs, packs or digests name leaves it does not hold")
            return cls(
                index=index,
                dir=name,
                leaves=leaves,
                structure=doc["structure"],
                replace=bool(doc["replace"]),
                processes=processes,
                refs={n: Reference.from_json(r) for n, r in refs.items()},
                packed=packed,
                digests=digests,
                item=item,
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable part record {where}: {exc}") from exc


@dataclass
class Joined:
    """A session's parts as one item: what `join` gives a finalize."""

    stores: list[str]  # every part's per-process stores, in part order
    clear: dict[str, list[str]]  # per store: the leaves replaced from there on (`merge`)
    structure: dict[str, Any]
    processes: list[dict[str, Any]]  # every part's process reports, tagged with the part
    latest: dict[str, Part]  # each leaf's last part: the one whose version the step keeps
    leaves: dict[str, LeafInfo]

    @property
    def held(self) -> dict[str, Reference]:
        """The leaves the step keeps by reference: leaf -> the attempt holding its bytes."""
        return {leaf: p.refs[leaf] for leaf, p in self.latest.items() if leaf in p.refs}

    @property
    def written(self) -> list[LeafInfo]:
        """The leaves the step's own stores hold (the merge validates these)."""
        held = self.held
        return [info for name, info in self.leaves.items() if name not in held]

    def item(self, prefix: str, references: References) -> ItemManifest:
        """The item's manifest; ``prefix``: the item's directory (the stores are named
        below it); the referenced attempts are added to ``references``."""
        held, latest = self.held, self.latest
        refs = {leaf: references.index(held[leaf]) for leaf in self.leaves if leaf in held}
        return ItemManifest(
            structure=self.structure,
            leaves=self.leaves,
            parts=[s.removeprefix(prefix + "/") for s in self.stores],
            packed={
                leaf: latest[leaf].packed[leaf] for leaf in refs if leaf in latest[leaf].packed
            },
            digests={
                leaf: latest[leaf].digests[leaf]
                for leaf in self.leaves
                if leaf in latest[leaf].digests
            },
            refs=refs,
        )


def join(parts: list[Part], where: AttemptDir, item: str) -> Joined:
    """``parts`` (in order) as one item: a later part's version of a leaf wins, and the
    earlier versions are cleared before its stores are merged, referenced or not."""
    joined = Joined([], {}, {"t": "dict", "keys": [], "items": []}, [], {}, {})
    for part in parts:
        replaced = sorted(set(joined.latest) & set(part.leaves))
        stores = [where.part_store(item, part.dir, p) for p in range(writers(part))]
        if replaced:
            joined.clear[stores[0]] = replaced
        joined.stores += stores
        joined.structure = merge_structures(joined.structure, part.structure)
        joined.processes += [{"part": part.index, **p} for p in part.processes]
        joined.latest.update({leaf: part for leaf in part.leaves})
        joined.leaves.update(part.leaves)
    return joined


def join_items(parts: list[Part], where: AttemptDir) -> dict[str, Joined]:
    """The parts of every item of a session, each item's joined (`join`), by item name."""
    names = sorted({part.item for part in parts})
    return {name: join([p for p in parts if p.item == name], where, name) for name in names}


@dataclass
class SessionPlan:
    """The commit engine's `Plan` of a finalize (`ckptstore.checkpoint.engine`): the
    session's recorded ``parts``, each item's joined (`join_items`: a later part's version of
    a leaf wins), then merged by reference. ``given``: structures given to finalize, by item;
    ``configs``: its JSON items."""

    backend: Backend
    where: AttemptDir
    base: Reference | None
    parts: list[Part]
    metadata: dict[str, Any]
    given: dict[str, dict[str, Any]]
    configs: dict[str, JsonItem]
    joined: dict[str, Joined] = field(default_factory=dict)
    seconds: float = 0.0  # of the merges

    async def join(self) -> None:
        self.joined = join_items(self.parts, self.where)
        for name, joined in self.joined.items():
            joined.structure = self.given.get(name) or joined.structure

    async def merge(self) -> Manifest:
        references = References([])
        items, processes = {}, []
        for name, joined in self.joined.items():
            prefix = self.where.item(name)
            merged = await merge(self.backend, prefix, joined.stores, joined.written, joined.clear)
            items[name] = joined.item(prefix, references)
            processes += joined.processes
            self.seconds += merged.seconds
        return Manifest(
            step=self.where.step,
            attempt=self.where.attempt,
            items=items,
            processes=processes,
            metadata=self.metadata,
            references=references.holders,
            # The commit re-checks the base before its marker (`protocol.check_base`).
            base=self.base if references.holders else None,
            format_version=needed_version(items, bool(references.holders)),
            json_items=self.configs,
        )


async def read_session(backend: Backend, where: AttemptDir, item: str) -> dict[str, Any] | None:
    """The session record of ``item`` in the attempt ``where``; None if there is none (or
    it is another item's), `CorruptCheckpointError` if it is unreadable."""
    key = where.session
    try:
        record = json.loads(await backend.read(key))
    except NotFoundError:
        return None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"unreadable session record {key}: {exc}") from exc
    if not isinstance(record, dict) or record.get("item") != item:
        return None
    return record


def session_base(record: dict[str, Any], where: AttemptDir, base: int | None) -> dict[str, Any]:
    """A resumed session's record, checked against the ``base`` its opener asked for:
    its base as ``{"step", "attempt"}`` (or None); `ConfigError` if it has another."""
    based = record.get("base")
    if based is not None and not is_attempt_ref(based):
        raise CorruptCheckpointError(
            f"unreadable session record {where.session}: bad base {str(based)[:80]}"
        )
    ref = None if based is None else Reference.from_json(based, "base")
    had = None if ref is None else ref.step
    if had != base:
        raise ConfigError(
            f"partial-save session {where.attempt} of step {where.step} was opened with "
            f"base={had}, not base={base}: open it with base={had}, or pass resume=False "
            "to start a new session"
        )
    return {"attempt": where.attempt, "base": None if ref is None else ref.to_json()}


def created(record: dict[str, Any]) -> float:
    """When a session record says its session began (0 if it does not say)."""
    when = record.get("created")
    return float(when) if isinstance(when, (int, float)) else 0.0


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


def nesting_conflicts(saved: set[str], new: list[str]) -> list[str]:
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


def writers(part: Part) -> int:
    """How many processes wrote ``part`` (each has its own store)."""
    return max(1, len(part.processes))
