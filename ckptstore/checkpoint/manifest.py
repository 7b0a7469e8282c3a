"""The checkpoint manifest: tree structure, leaves, per-process statistics, format version.

Stored as JSON at ``<step>/manifest.json`` and written before the commit marker.
It is parsed as data only (`json.loads`), never evaluated.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ckptstore.arrays import LeafInfo
from ckptstore.checkpoint.layout import FORMAT, FORMAT_VERSION
from ckptstore.errors import CorruptCheckpointError


@dataclass
class ItemManifest:
    """One item (a saved tree) of a checkpoint."""

    structure: dict[str, Any]
    leaves: dict[str, LeafInfo]
    parts: list[str] = field(default_factory=list)  # store directories merged, in order

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.leaves.values())


@dataclass
class Manifest:
    step: int
    items: dict[str, ItemManifest]
    processes: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items.values())

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "checksums": "crc32c per chunk (zarr3 crc32c codec), verified on every read",
            "metadata": self.metadata,
            "processes": self.processes,
            "items": {
                name: {
                    "structure": item.structure,
                    "parts": item.parts,
                    "leaves": {n: info.to_json() for n, info in item.leaves.items()},
                }
                for name, item in self.items.items()
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()  # C encoder: no indent

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} manifest")
            version = doc.get("format_version")
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise ValueError(
                    f"format version {version!r} is newer than this ckptstore reads "
                    f"({FORMAT_VERSION}); upgrade ckptstore"
                )
            items = {
                name: ItemManifest(
                    structure=item["structure"],
                    parts=list(item.get("parts", [])),
                    leaves={n: LeafInfo.from_json(n, d) for n, d in item["leaves"].items()},
                )
                for name, item in doc["items"].items()
            }
            return cls(
                step=int(doc["step"]),
                items=items,
                processes=list(doc.get("processes", [])),
                created=float(doc.get("created", 0.0)),
                metadata=dict(doc.get("metadata", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"unreadable manifest {where}: {exc}") from exc
