"""Streaming import of safetensors models into a checkpoint, through a partial save.

The model is never held in memory: tensors are read one at a time straight
from their files into a bounded batch, each batch is written as one part of a
`PartialSave`, and the part is freed before the next is read. Peak memory is
about the largest tensor plus the batch size. An interrupted import resumes:
tensors whose leaves a completed part already holds are skipped.

The safetensors format is parsed here (8-byte header length, a JSON header,
raw little-endian data): no code from the file is ever run.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ckptstore.checkpoint.partial import PartialSave
from ckptstore.checkpoint.save import SaveResult
from ckptstore.checkpoint.target import Target, opened
from ckptstore.errors import SafetensorsError
from ckptstore.format.casts import CastPolicy
from ckptstore.format.codecs import CodecPolicy
from ckptstore.format.tree import segment
from ckptstore.runtime.membudget import check_fits
from ckptstore.runtime.progress import Progress

MiB = 1 << 20
#: Tensor bytes per part. A batch is held twice while it is written (the tensors read from
#: the files, and TensorStore's copies), so the default keeps an import's added peak near the
#: largest tensor plus 128 MiB (`tests/importers` measures an import's peak).
DEFAULT_BATCH_BYTES = 64 * MiB
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * MiB

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: no data is read until `read`."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def read(self) -> np.ndarray[Any, Any]:
        """The tensor, read straight from the file into one new array.

        Its size was checked against the file's (`read_header`); a sparse file can still
        declare more than this process can map, which is refused before the buffer is
        sized (`InsufficientMemoryError`) rather than aborting or raising a bare
        `MemoryError`."""
        check_fits(self.nbytes, f"{self.file}: tensor {self.name!r}", leaf=self.name)
        dtype = np.dtype(DTYPES[self.dtype]).newbyteorder("<")
        count = self.nbytes // dtype.itemsize
        with open(self.file, "rb") as f:
            data = np.fromfile(f, dtype=dtype, count=count, offset=self.offset)
        if data.nbytes != self.nbytes:
            raise SafetensorsError(f"{self.file}: tensor {self.name!r} is truncated")
        return data.reshape(self.shape)


def read_header(file: Path) -> list[TensorRef]:
    """The tensors of one ``.safetensors`` file, from its JSON header only."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{file}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise SafetensorsError(f"{file}: header length {length} is impossible")
        try:
            header = json.loads(f.read(length), object_pairs_hook=_refuse_duplicates)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise SafetensorsError(f"{file}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{file}: header is not a JSON object")
    base = 8 + length
    refs = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError) as exc:
            raise SafetensorsError(f"{file}: bad header entry for {name!r}") from exc
        if not isinstance(code, str) or code not in DTYPES:
            raise SafetensorsError(f"{file}: tensor {name!r} has unsupported dtype {code!r}")
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise SafetensorsError(f"{file}: tensor {name!r} has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise SafetensorsError(f"{file}: tensor {name!r} has bad data offsets {offsets!r}")
        begin, end = offsets
        expected = math.prod(shape) * np.dtype(DTYPES[code]).itemsize  # exact: Python ints
        if not (begin <= end <= size - base) or end - begin != expected:
            raise SafetensorsError(f"{file}: tensor {name!r} has inconsistent data offsets")
        refs.append(TensorRef(name, file, code, tuple(shape), base + begin, end - begin))
    refs.sort(key=lambda r: r.offset)
    for a, b in itertools.pairwise(refs):
        if a.offset + a.nbytes > b.offset:
            raise SafetensorsError(f"{file}: tensors {a.name!r} and {b.name!r} overlap")
    return refs


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise SafetensorsError(f"the header names {dup!r} twice")
    return dict(pairs)


def _is_count(x: Any) -> bool:
    """A non-negative integer (not a bool, not a float)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def find_tensors(source: str | os.PathLike[str]) -> list[TensorRef]:
    """Every tensor of a model: one file, a sharded model's index, or a directory."""
    path = Path(source)
    if path.is_dir():
        index = path / INDEX_FILE
        if index.exists():
            return find_tensors(index)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"{path}: no .safetensors files")
    elif path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SafetensorsError(f"{path}: not a safetensors index: {exc}") from exc
        files = [path.parent / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if file.parent.resolve() != path.parent.resolve():
                raise SafetensorsError(f"{path}: shard {file.name!r} is outside the model folder")
    elif path.is_file():
        files = [path]
    else:
        raise SafetensorsError(f"{path}: no such file or directory")
    refs = [ref for file in files for ref in read_header(file)]
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise SafetensorsError(f"{source}: a tensor name appears in more than one file")
    return refs


# ---- mapping tensor names to tree paths ----


@dataclass(frozen=True)
class Rule:
    """One mapping rule: the first rule whose ``match`` fully matches a name applies."""

    match: re.Pattern[str]
    path: str | None = None  # template with \\1 or \\g<name>; default: the name split on "."
    transpose: tuple[int, ...] | bool = False
    dtype: str | None = None
    skip: bool = False


@dataclass(frozen=True)
class Placement:
    path: tuple[str, ...]
    transpose: tuple[int, ...] | bool
    dtype: np.dtype[Any] | None


@dataclass
class Rules:
    """Maps tensor names to tree paths, transposes and casts (see `load_rules`)."""

    rules: list[Rule] = field(default_factory=list)

    def apply(self, name: str) -> Placement | None:
        """Where ``name`` goes, or None if a rule skips it."""
        for rule in self.rules:
            found = rule.match.fullmatch(name)
            if found is None:
                continue
            if rule.skip:
                return None
            path = found.expand(rule.path) if rule.path is not None else name
            dtype = np.dtype(getattr(ml_dtypes, rule.dtype, rule.dtype)) if rule.dtype else None
            return Placement(split_path(path, "/" if rule.path else "."), rule.transpose, dtype)
        return Placement(split_path(name, "."), False, None)


def split_path(path: str, sep: str) -> tuple[str, ...]:
    parts = tuple(path.split(sep))
    if any(p == "" for p in parts):
        raise SafetensorsError(f"tree path {path!r} has an empty segment")
    return parts


def load_rules(file: str | os.PathLike[str] | None) -> Rules:
    """Read a TOML rule file; ``None`` gives the default mapping (split names on ``.``).

    ::

        [[rule]]
        match = 'model\\.layers\\.(\\d+)\\.mlp\\.(\\w+)\\.weight'   # regex, whole name
        path = 'layers/\\1/mlp/\\2/kernel'       # "/"-separated tree path
        transpose = true                        # or a permutation, e.g. [1, 0]
        dtype = "bfloat16"                      # cast
        [[rule]]
        match = 'lm_head\\.weight'
        skip = true
    """
    if file is None:
        return Rules()
    try:
        doc = tomllib.loads(Path(file).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SafetensorsError(f"rule file {file}: {exc}") from exc
    rules = []
    for i, raw in enumerate(doc.get("rule", [])):
        unknown = set(raw) - {"match", "path", "transpose", "dtype", "skip"}
        if unknown or "match" not in raw:
            raise SafetensorsError(
                f"rule file {file}: rule {i + 1}: needs 'match'; unknown keys {sorted(unknown)}"
            )
        try:
            pattern = re.compile(raw["match"])
        except re.error as exc:
            raise SafetensorsError(f"rule file {file}: rule {i + 1}: bad regex: {exc}") from exc
        transpose = raw.get("transpose", False)
        if isinstance(transpose, list):
            transpose = tuple(int(x) for x in transpose)
        dtype = raw.get("dtype")
        if dtype is not None:
            try:
                np.dtype(getattr(ml_dtypes, dtype, dtype))
            except TypeError as exc:
                raise SafetensorsError(f"rule file {file}: unknown dtype {dtype!r}") from exc
        rules.append(Rule(pattern, raw.get("path"), transpose, dtype, bool(raw.get("skip"))))
    return Rules(rules)


def convert(ref: TensorRef, target: Placement) -> np.ndarray[Any, Any]:
    """Read ``ref`` and apply the target's transpose and cast."""
    arr = ref.read()
    if target.transpose is True:
        arr = arr.T
    elif target.transpose:
        if sorted(target.transpose) != list(range(arr.ndim)):
            raise SafetensorsError(f"{ref.name}: transpose {target.transpose} for rank {arr.ndim}")
        arr = arr.transpose(target.transpose)
    if target.dtype is not None:
        arr = arr.astype(target.dtype)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def nest(items: Sequence[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """Build nested dicts from ``(path, value)`` pairs."""
    tree: dict[str, Any] = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise SafetensorsError(f"{'/'.join(path)}: {key!r} is both a tensor and a prefix")
            node = child
        if path[-1] in node:
            raise SafetensorsError(f"two tensors map to {'/'.join(path)}")
        node[path[-1]] = value
    return tree


def leaf_name(path: tuple[str, ...]) -> str:
    return "/".join(segment(jax.tree_util.DictKey(p)) for p in path)


# ---- the import ----


@dataclass(frozen=True)
class ImportResult:
    tensors: int  # imported in this run
    skipped: int  # skipped by rules or already saved by an earlier, interrupted run
    bytes: int
    parts: int
    save: SaveResult


def _batches(
    plan: list[tuple[TensorRef, Placement]], limit: int
) -> Iterator[list[tuple[TensorRef, Placement]]]:
    batch: list[tuple[TensorRef, Placement]] = []
    size = 0
    for ref, target in plan:
        if batch and size + ref.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append((ref, target))
        size += ref.nbytes
    if batch:
        yield batch


async def import_safetensors(
    source: str | os.PathLike[str],
    target: Target,
    *,
    step: int = 0,
    rules: Rules | str | os.PathLike[str] | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool | Progress = False,
    codecs: Any = None,
    casts: Any = None,
) -> ImportResult:
    """Import a safetensors model into ``target`` as checkpoint ``step``.

    ``codecs`` and ``casts``: how the leaves are stored, as `ckptstore.save`'s
    (docs/codecs.md): checked before anything is read or written."""
    codecs, casts = CodecPolicy.of(codecs), CastPolicy.of(casts)
    mapping = rules if isinstance(rules, Rules) else load_rules(rules)
    refs = find_tensors(source)
    plan = [(ref, t) for ref in refs if (t := mapping.apply(ref.name)) is not None]
    nest([(t.path, None) for _, t in plan])  # reject clashing paths before writing anything
    skipped = len(refs) - len(plan)
    async with opened(target) as backend, await PartialSave.open(backend, step) as session:
        done = set(session.leaves)
        todo = [(ref, t) for ref, t in plan if leaf_name(t.path) not in done]
        skipped += len(plan) - len(todo)
        bar = Progress.make(progress, len(todo), sum(r.nbytes for r, _ in todo), "tensors")
        parts = 0
        for batch in _batches(todo, batch_bytes):
            subtree = nest([(t.path, convert(ref, t)) for ref, t in batch])
            await session.add(subtree, codecs=codecs, casts=casts)
            del subtree
            parts += 1
            bar.advance(len(batch), sum(r.nbytes for r, _ in batch))
        result = await session.finalize(metadata={"imported_from": str(source)})
        bar.close()
    return ImportResult(
        tensors=len(todo),
        skipped=skipped,
        bytes=sum(r.nbytes for r, _ in todo),
        parts=parts,
        save=result,
    )
