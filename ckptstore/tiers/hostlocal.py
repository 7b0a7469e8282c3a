"""Host-local fast tiers: a multi-process save on `Tiered` storage whose fast tier is each
host's own NVMe (not one shared filesystem).

Process i can only write its own store, ``<step>/<attempt>/<item>/ocdbt.process_<i>/``, on
its own fast tier, and the merge must read every child store: no single fast tier can hold
a merged step. So there the save *stages* the step instead of committing it:

1. every process writes its store on its fast tier (as in any save);
2. process 0 writes the attempt's ``manifest.json`` on its fast tier and creates
   ``<step>/STAGED`` (the attempt, the manifest's digest, the number of processes);
3. every other process creates its own ``<step>/STAGED`` (the attempt, its index) once
   its store is complete; the save returns when every process has.

A staged step is not listed (no ``COMMITTED``). Promotion (`ckptstore.promote` called by
every process) uploads each process's part, then process 0 merges the stores by
reference *on the durable tier* (`merge_on_durable`, one TensorStore context for parents
and children: the OCDBT merge works on S3 and GCS that way) and creates the durable
``COMMITTED`` last.

Whether the fast tier is host-local is measured, not configured: process 0 writes a probe
object and every process looks for it (`fast_is_shared`).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import Iterable
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.merge import merge
from ckptstore.checkpoint.stagedrecord import STAGED as STAGED
from ckptstore.checkpoint.stagedrecord import Staged, read_staged, staged_key, staged_steps
from ckptstore.datapath.arrays import (
    addressable_indices,
    host_view_slices,
    write_store,
)
from ckptstore.errors import AlreadyExistsError, CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.leaves import LeafInfo
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import (
    COMMIT,
    Attempt,
    Marker,
    create_marker,
    digest,
    read_marker,
    read_marker_bytes,
)
from ckptstore.runtime.handoff import Handoff

log = logging.getLogger("ckptstore")
_PROBE = ".ckptstore-probe-"
#: Fast tiers (by URL) this process already probed, with the answer every process agreed on.
_probed: dict[tuple[str, int], bool] = {}


async def drop_staged(fast: Backend, step: int) -> None:
    """Remove this host's part of ``step`` from its fast tier: the marker first (what is
    left after a crash is garbage, not a staged part)."""
    await fast.delete(staged_key(step))
    await fast.delete_prefix(layout.step_dir(step) + "/")


async def is_promoted(durable: Backend, mine: Staged) -> bool:
    """Whether the durable tier has the staged step committed, from the same attempt."""
    marker = await read_marker(durable, mine.step)
    return marker is not None and marker.attempt == mine.attempt


def known_shared(fast: Backend, count: int) -> bool | None:
    """What `fast_is_shared` found for this fast tier in a job of ``count`` processes
    (None: not probed yet)."""
    return True if count == 1 else _probed.get((fast.url, count))


async def fast_is_shared(fast: Backend, handoff: Handoff) -> bool:
    """Whether every process sees process 0's fast tier (one filesystem), measured with a
    probe object; collective (every process calls it with the same ``handoff``). The answer
    is remembered per fast tier (every process remembers it at the same call, so later calls
    skip the probe on all of them alike)."""
    if handoff.count == 1:
        return True
    known = _probed.get((fast.url, handoff.count))
    if known is not None:
        return known

    async def write_probe() -> str:
        token = secrets.token_hex(8)
        await fast.write(_PROBE + token, b"probe")
        return token

    token = await handoff.agree(write_probe)

    async def look() -> dict[str, Any]:
        return {"sees": await fast.exists(_PROBE + token)}

    await handoff.everyone(look)

    async def decide() -> str:
        seen = all(r["sees"] for r in await handoff.reports())
        await fast.delete(_PROBE + token)
        return "shared" if seen else "local"

    shared = await handoff.agree(decide) == "shared"
    _probed[(fast.url, handoff.count)] = shared
    return shared


async def staged_everywhere(
    fast: Backend, handoff: Handoff, *, host_view: bool = False
) -> list[int]:
    """The steps every process has staged from the same attempt, by a job of as many
    processes with the same index (``host_view``: each with its host's own copy), ascending:
    a step staged on some processes only is a save that never finished, never promoted nor
    read. Collective: every process gets process 0's answer."""

    async def mine() -> dict[str, Any]:
        held = {}
        for step in await staged_steps(fast):
            try:
                record = await read_staged(fast, step)
            except CorruptCheckpointError as exc:
                log.warning("ckptstore: ignoring this host's staged step %d: %s", step, exc)
                continue
            if record is None or (host_view and not record.host_view):
                continue
            if (record.process, record.processes) != (handoff.me, handoff.count):
                continue  # staged by another topology
            held[str(step)] = record.attempt
        return {"staged": held}

    await handoff.everyone(mine)

    async def decide() -> str:
        reports = [r["staged"] for r in await handoff.reports()]
        common, partial = [], []
        for step, attempt in reports[0].items():
            if all(other.get(step) == attempt for other in reports[1:]):
                common.append(int(step))
            else:
                partial.append(int(step))
        if partial:
            log.warning(
                "ckptstore: steps %s are staged on process 0's fast tier but not by every "
                "process (saves that did not finish): not promoted, not listed",
                sorted(partial),
            )
        return json.dumps(sorted(common))

    return [int(step) for step in json.loads(await handoff.agree(decide))]


def can_write_host_view(values: Iterable[Any], me: int) -> bool:
    """Whether this process has every slice its devices hold at hand (not so for arrays
    staged without their ``extra`` pieces)."""
    return all(host_view_slices(value, me) is not None for value in values)


def host_view_bytes(values: Iterable[Any], me: int) -> int:
    """Payload bytes `write_host_view` adds to this process's fast tier."""
    return sum(
        math.prod(data.shape) * data.dtype.itemsize
        for value in values
        for _, data, _ in host_view_slices(value, me) or []
    )


async def write_host_view(
    fast: Backend, where: layout.AttemptDir, item: str, leaves: list[tuple[LeafInfo, Any]], me: int
) -> int:
    """Make this host's fast tier able to serve a restore on the same topology alone.

    Its own store (``ocdbt.process_<me>``) lacks, on processes other than 0, every leaf's
    ``zarr.json`` and the host values, and on every process the slices its devices hold as
    replicas whose replica 0 is elsewhere. Those go to ``local.process_<me>`` (never
    promoted); both stores are then merged by reference into the item's store on this fast
    tier, validated to hold every leaf's metadata and each chunk of the slices this host's
    devices hold. Returns the bytes written.
    """
    store = where.local_store(item, me)
    stats = await write_store(
        fast, store, leaves, process=me, write_metadata=me != 0, select=host_view_slices
    )
    regions = {info.name: addressable_indices(value) for info, value in leaves}
    children = [where.process_store(item, me), store]
    await merge(fast, where.item(item), children, [i for i, _ in leaves], regions=regions)
    return stats.bytes


async def stage(
    fast: Backend,
    step: int,
    attempt: str,
    me: int,
    count: int,
    manifest: Manifest | None,
    host_view: bool = False,
) -> None:
    """Record this process's complete part on its fast tier (process 0: with the manifest,
    written first)."""
    step_digest = None
    if manifest is not None:
        data = manifest.to_bytes()
        await fast.write(layout.AttemptDir(step, attempt).manifest, data)
        step_digest = digest(data)
    marker = Staged(step, attempt, me, count, step_digest, host_view)
    await fast.create(staged_key(step), marker.to_bytes())


def promoted_part(key: str, root: str, me: int) -> bool:
    """Whether ``key`` (below the attempt ``root``) is part of what process ``me``
    uploads: the manifest, and its own store (not its host view's stores)."""
    rel = key.removeprefix(root + "/").split("/")
    return rel == [layout.MANIFEST] or (len(rel) > 2 and rel[1] == f"ocdbt.process_{me}")


async def merge_on_durable(durable: Backend, mine: Staged) -> bytes:
    """Process 0, once every process's part is on ``durable``: merge each item's per-process
    stores there by reference, validate, and create the durable ``COMMITTED`` last.

    Returns the marker's bytes. A durable marker naming another attempt is
    `AlreadyExistsError`; one naming this attempt means it was done already.
    """
    where = layout.AttemptDir(mine.step, mine.attempt)
    key = layout.commit_key(mine.step)
    found = await read_marker_bytes(durable, mine.step)
    existing = found[1] if found is not None else None
    if existing is not None:
        if Marker.from_bytes(existing, step=mine.step, where=key).attempt != mine.attempt:
            raise AlreadyExistsError(
                "the durable tier has this step committed from another attempt",
                backend=durable.url,
                key=key,
            )
        return existing
    data = await durable.read(where.manifest)
    if digest(data) != mine.manifest_digest:
        raise CorruptCheckpointError(f"{durable.url}/{where.manifest} is not the staged manifest")
    owner = "merge-" + str(mine.manifest_digest).removeprefix("sha256:")[:32]
    fate = await Attempt(durable, where, owner).claim(COMMIT)  # every promoter of it is this owner
    manifest = Manifest.from_bytes(data, where=f"{durable.url}/{where.manifest}")
    for name, item in manifest.items.items():
        stores = [where.process_store(name, i) for i in range(mine.processes)]
        await merge(durable, where.item(name), stores, list(item.leaves.values()))
    marker = Marker(
        step=mine.step,
        attempt=mine.attempt,
        manifest_digest=mine.manifest_digest,
        token=secrets.token_hex(16),
        time=time.time(),
    ).to_bytes()
    fate.check_fresh(where)
    await create_marker(durable, mine.step, marker)
    return marker
