"""Names of everything a checkpoint stores, relative to the backend root.

Format version 3 (attempt-scoped; version 2 is the same without packs; version 4 is a
manifest whose leaves may be held by other attempts: incremental saves):

```
<step>/
  COMMITTED                               created last, create-if-absent: names the
                                          attempt and carries its manifest's digest
  REVOKED.0                               created by a deletion of that commit (never
                                          removed before `fates.CLAIM_TTL`)
  COMMITTED.<n>, REVOKED.<n>              the step's n-th commit after n deletions, and
                                          its deletion: markers are superseded, never
                                          taken back by a key someone else may reuse
  <attempt>/                              one per save attempt or partial-save session
    FATE                                  the attempt's fate (commit, abandon, collect),
                                          created once by whoever decides it (`commit`)
    DELETED                               left by `delete_step` on tiers: a promotion in
                                          flight must not bring the step back
    manifest.json                         tree structure, leaves, step, attempt
    SESSION.json                          partial-save sessions only: lets a resumer find it
    <item>/                               e.g. "state"
      ocdbt.process_<i>/                  process i's own OCDBT store (a save)
        pack-<k>                          its small leaves, packed (`ckptstore.format.packs`); the
                                          manifest says where each one starts
      local.process_<i>/                  host-local fast tiers only: what else process i
                                          needs to restore alone (never promoted)
      pending_<k>-<token>/ocdbt.process_<i>/   part k of a partial save
      parts/<k>.json                      the record of part k, created last
      manifest.ocdbt, d/                  the merged OCDBT store: references only
```

Format version 1 had no attempt level: ``<step>/manifest.json`` and ``<step>/<item>/``.
All three are read; an `AttemptDir` with ``attempt=None`` names a version-1 step.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ckptstore.errors import InvalidKeyError, InvalidStepError

MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
REVOKED = "REVOKED"
SESSION = "SESSION.json"
FATE = "FATE"
DELETED = "DELETED"
#: Records that outlive an attempt's data for a while (`commit.clear_attempt`).
TOMBSTONES = (FATE, DELETED)
PARTS = "parts"
DEFAULT_ITEM = "state"
FORMAT = "ckptstore"
#: The newest format read and written. 3: an item's small leaves may be packed
#: (`ckptstore.format.packs`); 4: an item's leaves may be held by another attempt
#: (incremental saves, docs/incremental.md); 5: a leaf may be compressed or cast
#: (`ckptstore.format.codecs`, `ckptstore.format.casts`), or held in part, chunk by chunk,
#: by other attempts (chunk references). A step is written as the oldest version that
#: describes it (`ckptstore.format.manifest.needed_version`), so that older readers read
#: what they can and refuse, by version, what they would misread.
FORMAT_VERSION = 5
REFERENCES_VERSION = 4
PLAIN_VERSION = 3

# ---- Orbax's names, which gc must recognise beside ckptstore's (`ckptstore.orbax` reads and
# writes them) ----

#: An Orbax tree item's metadata file (``<item>/_METADATA``).
ORBAX_TREE_METADATA = "_METADATA"
#: An Orbax step's metadata file.
ORBAX_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
#: Orbax's finalization marker, of a step and of each of its items.
ORBAX_COMMIT_SUCCESS = "commit_success.txt"
#: Files Orbax writes at the top of a step directory or of an item in it.
ORBAX_FILES = frozenset({ORBAX_TREE_METADATA, ORBAX_CHECKPOINT_METADATA, ORBAX_COMMIT_SUCCESS})

_ATTEMPT = re.compile(r"attempt-[0-9]{8}T[0-9]{6}-[0-9a-f]{12}")


def check_step(step: int) -> int:
    """Steps are non-negative integers; returns the step as a Python int.

    NumPy integers and 0-d integer arrays (a JAX train state's ``step``) count as integers.
    The error names what was given by type when its repr is long: a tree passed where the
    step goes (``restore(target, state)``) is not printed whole.
    """
    if _integer_scalar(step):
        step = int(step)
    if isinstance(step, int) and not isinstance(step, bool):
        if step >= 0:
            return step
        raise InvalidStepError(f"step must be a non-negative int, got {step}")
    shown = repr(step)
    if len(shown) > 40 or "\n" in shown:
        shown = f"a {type(step).__module__}.{type(step).__qualname__}".replace("builtins.", "")
    hint = ""
    if isinstance(step, Mapping | list | tuple) or hasattr(step, "shape"):
        hint = " (a tree where the step goes? restore(target, step, like) takes it as like=)"
    raise InvalidStepError(f"step must be a non-negative int, got {shown}{hint}")


def _integer_scalar(value: object) -> bool:
    """A NumPy integer, or a 0-d array (NumPy, JAX) of an integer dtype; bools are not."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "shape", None) != () or isinstance(value, bool):
        return False
    return getattr(dtype, "kind", None) in ("i", "u")


_ITEM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_RESERVED_ITEMS = {
    PARTS,
    MANIFEST,
    SESSION,
    FATE,
    DELETED,
    COMMIT_MARKER,
    REVOKED,
    "d",
    "manifest.ocdbt",
}


def check_item(item: str) -> str:
    """Item names are one safe path segment: letters, digits, ``_``, ``.`` and ``-``."""
    if not isinstance(item, str) or not _ITEM.fullmatch(item) or item in _RESERVED_ITEMS:
        raise InvalidKeyError(
            f"item name must be 1-100 of [A-Za-z0-9_.-] (not starting with . or -) and "
            f"not one of {sorted(_RESERVED_ITEMS)}; got {item!r}"
        )
    return item


def is_item(name: str) -> bool:
    """Whether ``name`` is a valid item name (`check_item`) rather than raising."""
    return isinstance(name, str) and bool(_ITEM.fullmatch(name)) and name not in _RESERVED_ITEMS


def step_dir(step: int) -> str:
    return str(check_step(step))


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a step directory.

    Only ASCII digits without leading zeros: "05", superscript or full-width digits are not steps.
    """
    if not (name.isascii() and name.isdigit()) or (name != "0" and name.startswith("0")):
        return None
    return int(name)


def new_attempt() -> str:
    """A fresh attempt id: sortable by creation time, unique by 48 random bits."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"attempt-{stamp}-{secrets.token_hex(6)}"


def is_attempt(name: str) -> bool:
    return _ATTEMPT.fullmatch(name) is not None


def commit_key(step: int, index: int = 0) -> str:
    """The key of ``step``'s ``index``-th commit marker (``COMMITTED``, then ``COMMITTED.1``...)."""
    name = COMMIT_MARKER if index == 0 else f"{COMMIT_MARKER}.{index}"
    return f"{step_dir(step)}/{name}"


def revoked_key(step: int, index: int) -> str:
    """The key of the record that revokes ``step``'s ``index``-th commit (its deletion)."""
    return f"{step_dir(step)}/{REVOKED}.{index}"


_RECORD = re.compile(r"(COMMITTED|REVOKED)(?:\.(0|[1-9][0-9]{0,8}))?")


def parse_step_record(name: str) -> tuple[str, int] | None:
    """(``COMMIT_MARKER`` or ``REVOKED``, index) for a step directory's commit or revocation
    record, or None for any other entry (an attempt, a version-1 file)."""
    match = _RECORD.fullmatch(name)
    if match is None or (match[1] == REVOKED and match[2] is None):
        return None
    index = int(match[2]) if match[2] is not None else 0
    if match[1] == COMMIT_MARKER and match[2] == "0":
        return None  # the 0th commit is plain COMMITTED
    return match[1], index


@dataclass(frozen=True)
class AttemptDir:
    """Where one attempt of one step lives; ``attempt=None`` is a version-1 step."""

    step: int
    attempt: str | None

    @property
    def root(self) -> str:
        base = step_dir(self.step)
        return f"{base}/{self.attempt}" if self.attempt is not None else base

    @property
    def manifest(self) -> str:
        return f"{self.root}/{MANIFEST}"

    @property
    def session(self) -> str:
        return f"{self.root}/{SESSION}"

    @property
    def fate(self) -> str:
        return f"{self.root}/{FATE}"

    @property
    def deleted(self) -> str:
        return f"{self.root}/{DELETED}"

    def item(self, item: str) -> str:
        return f"{self.root}/{item}"

    def process_store(self, item: str, process: int) -> str:
        return f"{self.item(item)}/ocdbt.process_{process}"

    def local_store(self, item: str, process: int) -> str:
        """Process ``process``'s extra store on a host-local fast tier (`hostlocal`)."""
        return f"{self.item(item)}/local.process_{process}"

    def part_dir(self, item: str, name: str) -> str:
        return f"{self.item(item)}/{name}"

    def part_store(self, item: str, name: str, process: int) -> str:
        return f"{self.part_dir(item, name)}/ocdbt.process_{process}"

    def parts(self, item: str) -> str:
        return f"{self.item(item)}/{PARTS}"

    def part_record(self, item: str, index: int) -> str:
        return f"{self.parts(item)}/{index}.json"


def new_part_name(index: int) -> str:
    """A part directory no other writer picks, even for the same index."""
    return f"pending_{index}-{secrets.token_hex(4)}"
