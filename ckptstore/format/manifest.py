"""The checkpoint manifest: tree structure, leaves, per-process statistics, format version.

Stored as JSON at ``<step>/<attempt>/manifest.json`` and written before the commit
marker, which carries its digest. It is parsed as data only (`json.loads`), never
evaluated, and checked field by field: a manifest a restore could misread is
`CorruptCheckpointError`, never a traceback or a silently different tree.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.backends.keys import validate_key
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import chunks, layout
from ckptstore.format.casts import SOURCES as CAST_SOURCES
from ckptstore.format.chunkrefs import ChunkRefs, decode_digests
from ckptstore.format.digests import (
    ALGORITHM,
    LEGACY,
    PieceTable,
    check_table,
    chunk_count,
    chunks_size,
)
from ckptstore.format.jsonitems import JsonItem
from ckptstore.format.leaves import LeafInfo, dtype_of
from ckptstore.format.packs import PackRef
from ckptstore.format.tree import check_leaf_name, check_leaf_paths, check_structure
from ckptstore.runtime.gcpause import gc_paused

KINDS = ("jax", "numpy", "scalar")
PYTHON_TYPES = (None, "int", "float", "bool", "complex")
MAX_RANK = 64
#: A PRNG implementation's name (`LeafInfo.prng_impl`): jax's are "threefry2x32", "rbg"...
IMPL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class Reference:
    """Another attempt whose bytes some of a manifest's leaves are read from (an entry of
    `Manifest.references`), or the committed step an incremental save named as its base
    (`Manifest.base`). Stored as ``{"step": s, "attempt": a}``; hashable, so a set or a
    dict key."""

    step: int
    attempt: str

    @property
    def dir(self) -> layout.AttemptDir:
        """The attempt's directory."""
        return layout.AttemptDir(self.step, self.attempt)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt}

    @classmethod
    def from_json(cls, doc: Any, what: str = "reference") -> Reference:
        """``doc`` as a reference (`is_attempt_ref`); ValueError naming it as ``what``
        (``bad reference {...}``) if it is not one."""
        _expect(is_attempt_ref(doc), f"bad {what} {str(doc)[:80]}")
        return cls(doc["step"], doc["attempt"])


@dataclass
class ItemManifest:
    """One item (a saved tree) of a checkpoint."""

    structure: dict[str, Any]
    leaves: dict[str, LeafInfo]
    parts: list[str] = field(default_factory=list)  # store directories merged, in order
    #: Leaves stored in packs (`ckptstore.format.packs`) rather than in the merged store.
    packed: dict[str, PackRef] = field(default_factory=dict)
    #: Each leaf's piece digests (`ckptstore.format.digests`): what lets a later save use
    #: this step as its base. Absent for leaves saved before digests were recorded.
    digests: dict[str, PieceTable] = field(default_factory=dict)
    #: The algorithm of ``digests`` (written as the item's ``digest``; `LEGACY` when a
    #: manifest has digests but no such field). Tables of another algorithm than this
    #: version's (`ckptstore.format.digests.ALGORITHM`) are never compared.
    digest_algorithm: str = ALGORITHM
    #: Leaves whose bytes another attempt holds (an incremental save): leaf -> index into
    #: `Manifest.references`. Such a leaf is read from the same item of that attempt (its
    #: merged store, or its pack where ``packed`` names one), not from this attempt's.
    refs: dict[str, int] = field(default_factory=dict)
    #: Leaves of several chunks, each chunk's digest (`ckptstore.format.chunkrefs`): what
    #: lets a later save write only the chunks that changed.
    chunk_digests: dict[str, str] = field(default_factory=dict)
    #: Leaves some of whose chunks other attempts hold (`ChunkRefs`: chunk-level references
    #: of an incremental save); their other chunks and ``zarr.json`` are this attempt's.
    chunk_refs: dict[str, ChunkRefs] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.leaves.values())

    @property
    def referenced_bytes(self) -> int:
        """Payload bytes of the leaves, and of the chunks, another attempt holds."""
        whole = sum(self.leaves[name].nbytes for name in self.refs)
        return whole + sum(self.held_chunk_bytes(name) for name in self.chunk_refs)

    def held_chunk_bytes(self, leaf: str) -> int:
        """Payload bytes of ``leaf``'s chunks that other attempts hold."""
        held = self.chunk_refs.get(leaf)
        if held is None:
            return 0
        info = self.leaves[leaf]
        linears = (linear for linear, _ in held.chunks())
        return dtype_of(info.dtype).itemsize * chunks_size(linears, info.shape, info.chunk_shape)


@dataclass
class Manifest:
    step: int
    items: dict[str, ItemManifest]
    attempt: str | None = None  # None: a format-version-1 checkpoint (no attempt level)
    processes: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Other attempts whose data this one references; `delete_step` and `gc` keep them
    #: (see docs/incremental.md).
    references: list[Reference] = field(default_factory=list)
    #: The committed step an incremental save named as its base: the commit checks it is
    #: still committed (`protocol.check_base`). None otherwise.
    base: Reference | None = None
    #: Seconds per phase of the save ("staging", "write", "merge"), for `ckptstore info`.
    timings: dict[str, float] = field(default_factory=dict)
    #: The oldest format version that describes this manifest (`needed_version`).
    format_version: int = layout.PLAIN_VERSION
    #: Items that are configuration, not arrays (`ckptstore.format.jsonitems`): their
    #: JSON is kept here, under the marker's digest. Readers before them ignore this field.
    json_items: dict[str, JsonItem] = field(default_factory=dict)

    @property
    def item_names(self) -> list[str]:
        """Every item, arrays and JSON, sorted."""
        return sorted([*self.items, *self.json_items])

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items.values())

    def item_dir(self, item: str) -> str:
        """The directory of ``item`` (its merged store, process stores and packs) in this
        manifest's attempt."""
        return layout.AttemptDir(self.step, self.attempt).item(item)

    def holder(self, item: str, leaf: str) -> Reference | None:
        """The other attempt holding ``leaf``'s bytes whole (an incremental save's leaf
        reference); None: this attempt holds them, all or (`chunk_refs`) some of them."""
        k = self.items[item].refs.get(leaf)
        return None if k is None else self.references[k]

    def chunk_holders(
        self, item: str, leaf: str, linears: np.ndarray[Any, np.dtype[np.int64]]
    ) -> list[tuple[Reference | None, np.ndarray[Any, np.dtype[np.bool_]]]]:
        """The other attempts holding the chunks ``linears`` (C order) of ``leaf``: the
        leaf's `holder`, or each chunk's (`chunk_refs`); None: this attempt holds them.
        Each holder once, with a mask of its chunks in ``linears``, in the order of its
        first chunk there. Vectorized: a table has thousands of chunks."""
        whole = self.holder(item, leaf)
        held = self.items[item].chunk_refs.get(leaf)
        if whole is not None or held is None:
            return [(whole, np.ones(linears.size, np.bool_))] if linears.size else []
        owners = held.owners(linears)
        kinds, first = np.unique(owners, return_index=True)
        return [
            (None if k < 0 else self.references[k], owners == k)
            for k in kinds[np.argsort(first)].tolist()
        ]

    def held(self, item: str) -> dict[Reference, frozenset[str]]:
        """Each other attempt holding leaves of ``item`` whole, with those leaves, in the
        order of `references`."""
        refs = self.items[item].refs
        return {
            self.references[k]: frozenset(n for n, i in refs.items() if i == k)
            for k in sorted(set(refs.values()))
        }

    def leaf_dir(self, item: str, leaf: str) -> str:
        """The item directory holding ``leaf``'s bytes: this attempt's own, or (a reference
        of an incremental save) the same item of the attempt the references name for it."""
        holder = self.holder(item, leaf)
        return self.item_dir(item) if holder is None else holder.dir.item(item)

    def holder_dirs(self, item: str, leaf: str) -> dict[int, str]:
        """For a leaf with chunk references: each holder's reference index -> the same item
        of that attempt (where its chunks of the leaf are read)."""
        held = self.items[item].chunk_refs.get(leaf)
        if held is None:
            return {}
        return {k: self.references[k].dir.item(item) for k in held.held}

    def to_bytes(self) -> bytes:
        with gc_paused():  # one object per field of thousands of leaves: see `gcpause`
            return json.dumps(self._doc(), separators=(",", ":")).encode()  # C encoder

    def _doc(self) -> dict[str, Any]:
        return {
            "format": layout.FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "created": self.created,
            "checksums": "crc32c per chunk (zarr3 crc32c codec), verified on every read",
            "metadata": self.metadata,
            "references": [ref.to_json() for ref in self.references],
            "timings": self.timings,
            "processes": self.processes,
            "items": {
                name: {
                    "structure": item.structure,
                    "parts": item.parts,
                    "leaves": {n: info.to_json() for n, info in item.leaves.items()},
                    "packed": {n: ref.to_json() for n, ref in item.packed.items()},
                    **(
                        {"digest": item.digest_algorithm, "digests": item.digests}
                        if item.digests
                        else {}
                    ),
                    **({"refs": item.refs} if item.refs else {}),
                    **({"chunk_digests": item.chunk_digests} if item.chunk_digests else {}),
                    **(
                        {"chunk_refs": {n: c.to_json() for n, c in item.chunk_refs.items()}}
                        if item.chunk_refs
                        else {}
                    ),
                }
                for name, item in self.items.items()
            },
            **({"base": self.base.to_json()} if self.base is not None else {}),
            **(
                {"json_items": {n: j.to_json() for n, j in self.json_items.items()}}
                if self.json_items
                else {}
            ),
        }

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        try:
            with gc_paused():  # one object per field of thousands of leaves: see `gcpause`
                return _parse(json.loads(data))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"unreadable manifest {where}: {exc}") from exc


def _parse(doc: Any) -> Manifest:
    _expect(isinstance(doc, dict), "not a JSON object")
    _expect(doc.get("format") == layout.FORMAT, f"not a {layout.FORMAT} manifest")
    version = doc.get("format_version")
    _expect(_is_int(version) and version >= 1, f"bad format version {version!r}")
    if version > layout.FORMAT_VERSION:
        raise ValueError(
            f"format version {version} is newer than this ckptstore reads "
            f"({layout.FORMAT_VERSION}); upgrade ckptstore"
        )
    step = doc["step"]
    _expect(_is_int(step) and step >= 0, f"bad step {step!r}")
    attempt = doc.get("attempt")
    if version >= 2:
        _expect(isinstance(attempt, str) and layout.is_attempt(attempt), f"bad attempt {attempt!r}")
    created = doc.get("created", 0.0)
    _expect(isinstance(created, (int, float)) and math.isfinite(created), "bad creation time")
    _expect(isinstance(doc.get("metadata", {}), dict), "metadata is not an object")
    for name in ("processes", "references"):
        _expect(isinstance(doc.get(name, []), list), f"{name} is not a list")
    references_doc = doc.get("references", [])
    # gc and delete_step keep what these name
    references = [Reference.from_json(ref) for ref in references_doc]
    base_doc = doc.get("base")
    base = None if base_doc is None else Reference.from_json(base_doc, "base")
    # The cycle checks compare the documents, as they always have (keys beyond "step"
    # and "attempt" are ignored when read, and make an entry differ here).
    itself = {"step": step, "attempt": attempt}
    _expect(itself not in references_doc, "it references its own attempt (a reference cycle)")
    _expect(base_doc != itself, "it names its own attempt as its base (a reference cycle)")
    timings = doc.get("timings", {})
    _expect(
        isinstance(timings, dict) and all(isinstance(v, (int, float)) for v in timings.values()),
        "timings are not numbers",
    )
    json_doc = doc.get("json_items", {})
    _expect(isinstance(json_doc, dict), "json_items is not an object")
    _expect(isinstance(doc["items"], dict) and bool(doc["items"] or json_doc), "no items")
    json_items = {layout.check_item(n): JsonItem.from_json(n, j) for n, j in json_doc.items()}
    both = sorted(set(json_items) & set(doc["items"]))
    _expect(not both, f"items {both} are both arrays and JSON")
    return Manifest(
        step=step,
        attempt=attempt if version >= 2 else None,
        items={
            name: _parse_item(name, item, len(references)) for name, item in doc["items"].items()
        },
        processes=list(doc.get("processes", [])),
        created=float(created),
        metadata=dict(doc.get("metadata", {})),
        references=references,
        base=base,
        timings={str(k): float(v) for k, v in timings.items()},
        format_version=version,
        json_items=json_items,
    )


def is_attempt_ref(ref: Any) -> bool:
    """Whether ``ref`` names an attempt as ``references`` and ``base`` do:
    ``{"step": s, "attempt": a}``."""
    return (
        isinstance(ref, dict)
        and _is_int(ref.get("step"))
        and ref["step"] >= 0
        and isinstance(ref.get("attempt"), str)
        and layout.is_attempt(ref["attempt"])
    )


def _parse_item(name: str, item: Any, references: int = 0) -> ItemManifest:
    layout.check_item(name)  # a CkptStoreError and ValueError: reported as corrupt
    _expect(isinstance(item, dict), f"item {name!r} is not an object")
    leaves_doc = item["leaves"]
    _expect(isinstance(leaves_doc, dict), f"item {name!r}: leaves is not an object")
    leaves = {n: parse_leaf(n, d) for n, d in leaves_doc.items()}
    parts = item.get("parts", [])
    _expect(isinstance(parts, list) and all(isinstance(p, str) for p in parts), "bad parts")
    for part in parts:  # store directories below the item: relative, never up and out
        validate_key(part)
    structure = item["structure"]
    named = check_structure(structure)
    check_leaf_paths(structure)
    _expect(
        named == set(leaves),
        f"item {name!r}: the structure's leaves and the leaf table differ "
        f"({sorted(named ^ set(leaves))[:5]})",
    )
    packed_doc = item.get("packed", {})
    _expect(isinstance(packed_doc, dict), f"item {name!r}: packed is not an object")
    packed = {n: PackRef.from_json(n, ref) for n, ref in packed_doc.items()}
    for leaf in packed:  # only small single-chunk leaves are packed
        info = leaves.get(leaf)
        if info is None:
            raise ValueError(f"packed leaf {leaf!r} is not in the leaf table")
        if not chunks.small(info):
            shape = list(info.shape)
            raise ValueError(f"leaf {leaf!r} cannot be packed (shape {shape}, {info.nbytes} bytes)")
        packed[leaf].check(info)  # a compressed entry's size, and only there
    digests_doc = item.get("digests", {})
    _expect(isinstance(digests_doc, dict), f"item {name!r}: digests is not an object")
    digests = {n: check_table(n, t) for n, t in digests_doc.items()}
    algorithm = item.get("digest", LEGACY)
    _expect(isinstance(algorithm, str) and len(algorithm) < 64, f"item {name!r}: bad digest")
    refs_doc = item.get("refs", {})
    _expect(isinstance(refs_doc, dict), f"item {name!r}: refs is not an object")
    for leaf, k in refs_doc.items():  # an index into the manifest's references
        _expect(_is_int(k) and 0 <= k < references, f"leaf {leaf!r}: bad reference {k!r}")
    unknown = sorted((set(digests) | set(refs_doc)) - set(leaves))
    _expect(not unknown, f"item {name!r}: digests or refs of unknown leaves {unknown[:5]}")
    chunk_digests, chunk_refs = _parse_chunks(name, item, leaves, references)
    both = sorted((set(refs_doc) | set(packed)) & set(chunk_refs))
    _expect(not both, f"item {name!r}: leaves {both[:5]} have chunk references and are whole")
    return ItemManifest(
        structure=structure,
        leaves=leaves,
        parts=list(parts),
        packed=packed,
        digests=digests,
        digest_algorithm=algorithm,
        refs=dict(refs_doc),
        chunk_digests=chunk_digests,
        chunk_refs=chunk_refs,
    )


def _parse_chunks(
    name: str, item: dict[str, Any], leaves: dict[str, LeafInfo], references: int
) -> tuple[dict[str, str], dict[str, ChunkRefs]]:
    """An item's chunk digests and chunk references (`ckptstore.format.chunkrefs`),
    checked against its leaves' chunk grids and the manifest's references."""
    digests_doc = item.get("chunk_digests", {})
    refs_doc = item.get("chunk_refs", {})
    _expect(isinstance(digests_doc, dict), f"item {name!r}: chunk_digests is not an object")
    _expect(isinstance(refs_doc, dict), f"item {name!r}: chunk_refs is not an object")
    unknown = sorted((set(digests_doc) | set(refs_doc)) - set(leaves))
    _expect(not unknown, f"item {name!r}: chunk records of unknown leaves {unknown[:5]}")
    counts = {
        n: chunk_count(leaves[n].shape, leaves[n].chunk_shape) for n in {*digests_doc, *refs_doc}
    }
    for leaf in refs_doc:  # only a leaf of several chunks is held in part
        _expect(counts[leaf] > 1, f"leaf {leaf!r}: chunk references of a single-chunk leaf")
    digests = {n: decode_digests(n, t, counts[n]) for n, t in digests_doc.items()}
    refs = {n: ChunkRefs.from_json(n, d, references, counts[n]) for n, d in refs_doc.items()}
    return digests, refs


def parse_leaf(name: str, d: Any) -> LeafInfo:
    """One leaf's record, checked field by field (a manifest's, or a partial save's part
    record's); raises ValueError (or its subclasses) naming the problem."""
    # Plain ifs, not `_expect`: a message is formatted only when a check fails, and a
    # manifest of thousands of leaves runs these checks thousands of times.
    if not isinstance(name, str) or name == "":
        raise ValueError("empty leaf name")
    check_leaf_name(name)
    if not isinstance(d, dict):
        raise ValueError(f"leaf {name!r} is not an object")
    shape, chunks = d["shape"], d["chunk_shape"]
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK and _dims_ok(shape)):
        raise ValueError(f"leaf {name!r}: bad shape")
    if not (isinstance(chunks, list) and len(chunks) == len(shape) and _chunks_ok(chunks, shape)):
        raise ValueError(f"leaf {name!r}: bad chunk shape")
    if not isinstance(d["dtype"], str):
        raise ValueError(f"leaf {name!r}: bad dtype")
    dtype_of(d["dtype"])  # raises for dtypes TensorStore cannot hold
    if d["kind"] not in KINDS:
        raise ValueError(f"leaf {name!r}: bad kind {d['kind']!r}")
    python_type = d.get("python_type")
    if python_type not in PYTHON_TYPES and python_type == d["dtype"] and d["kind"] == "scalar":
        # Written before numpy scalars (np.float64 is a Python float too) were told apart
        # from Python numbers: it was a numpy scalar of that dtype, and comes back as one.
        d = {**d, "python_type": None}
        python_type = None
    if python_type not in PYTHON_TYPES:
        raise ValueError(f"leaf {name!r}: bad python type {python_type!r}")
    if python_type is not None and shape != []:
        raise ValueError(f"leaf {name!r}: a Python number with a shape")
    sharding = d.get("sharding")
    if sharding is not None and not isinstance(sharding, dict):
        raise ValueError(f"leaf {name!r}: bad sharding")
    prng_impl = d.get("prng_impl")  # absent before typed PRNG keys were saved
    if prng_impl is not None and not (
        isinstance(prng_impl, str) and IMPL_NAME.fullmatch(prng_impl)
    ):
        raise ValueError(f"leaf {name!r}: bad PRNG implementation {str(prng_impl)[:40]!r}")
    if prng_impl is not None and (d["kind"] != "jax" or shape == []):
        raise ValueError(f"leaf {name!r}: PRNG key data must be a jax array of rank 1 or more")
    cast_from = d.get("cast_from")  # absent unless a lossy cast was asked for
    if cast_from is not None and not (
        cast_from in CAST_SOURCES and d["kind"] in ("jax", "numpy") and cast_from != d["dtype"]
    ):
        raise ValueError(f"leaf {name!r}: bad cast_from {str(cast_from)[:40]!r}")
    info = LeafInfo.from_json(name, d)
    if info.nbytes >= 2**63:
        raise ValueError(f"leaf {name!r}: impossibly large")
    return info


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# Loops, not ``all(...)`` over generators: thousands of leaves run these (a third of the
# time a 5,000-leaf manifest took to parse went to generator set-up).
def _dims_ok(shape: list[Any]) -> bool:
    """Every dimension an int in [0, 2**63)."""
    for x in shape:
        if not (_is_int(x) and 0 <= x < 2**63):
            return False
    return True


def _chunks_ok(chunks: list[Any], shape: list[int]) -> bool:
    """Every chunk dimension an int in [1, its dimension] (1 along an empty axis): a save's
    chunks are never larger than the leaf."""
    for c, n in zip(chunks, shape, strict=True):  # lengths checked by the caller
        if not (_is_int(c) and 1 <= c <= max(1, n)):
            return False
    return True


def _expect(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


def needed_version(items: Mapping[str, ItemManifest], referenced: bool) -> int:
    """The oldest format version that describes ``items`` (``referenced``: some leaf is
    held by another attempt): a reader of an older version refuses it, naming the version,
    rather than read compressed bytes as raw ones or a leaf held in part as a whole one."""
    leaves = (info for item in items.values() for info in item.leaves.values())
    if any(info.codec is not None or info.cast_from is not None for info in leaves) or any(
        item.chunk_refs for item in items.values()
    ):
        return layout.FORMAT_VERSION
    return layout.REFERENCES_VERSION if referenced else layout.PLAIN_VERSION
