"""Steps staged on host-local fast tiers, restored on the same hosts while the durable tier
is down.

On host-local fast tiers (`ckptstore.tiers.hostlocal`) a step is committed only when its
promotion merges the hosts' parts on the durable tier; until then each host holds its part,
staged, and (where its devices' slices fit) its own copy of every slice its devices hold
(`hostlocal.write_host_view`), and process 0 holds the step's manifest. A job restarted on
the same hosts while the durable tier does not answer reads those copies:

- `staged_at_start` (collective, at a manager's start): the staged steps every process
  holds a host copy of, from one attempt, that process 0 holds the manifest of
  (`hostlocal.staged_everywhere`), and the durable tier does not list (they wait for their
  promotion);
  of the newest of them, process 0 reads the manifest, checked against the digest its
  ``STAGED`` record holds, and every process gets it (`StagedSteps`);
- a restore of that step (`tiers.read.restore` given that manifest) reads each process's
  devices' slices from its own copy (where that cannot serve, another topology say, the
  tiers are read as usual).

Both hold the same attempt promotion commits later, so either read gives the same tree.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from ckptstore.backends.base import Backend
from ckptstore.checkpoint.stagedrecord import read_staged
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format import layout
from ckptstore.format.manifest import Manifest
from ckptstore.protocol import digest
from ckptstore.runtime import distributed
from ckptstore.runtime.handoff import Handoff
from ckptstore.tiers.bounded import durable_steps
from ckptstore.tiers.hostlocal import fast_is_shared, staged_everywhere

log = logging.getLogger("ckptstore")


@dataclass
class StagedSteps:
    """What `staged_at_start` found: the steps staged on every host that the durable tier
    does not list (they wait for their promotion), and the newest one's manifest (process
    0's, every process gets it), which a restore reads with this host's own copy."""

    waiting: list[int] = field(default_factory=list)
    newest: Manifest | None = None


async def staged_at_start(fast: Backend, durable: Backend, timeout: float) -> StagedSteps:
    """At a manager's start on tiers with several processes (collective): the staged steps
    the durable tier does not list (not promoted yet, or it does not answer process 0), of
    those every host holds a copy of (`hostlocal.staged_everywhere`); none on a fast tier
    every process shares. A newest step whose manifest process 0 cannot read is left to
    its promotion, with a warning: the manager opens all the same."""
    if distributed.process_count() == 1:
        return StagedSteps()
    handoff = Handoff("manager/staged", timeout)
    if await fast_is_shared(fast, handoff):
        return StagedSteps()

    async def listed() -> str:
        return json.dumps(await durable_steps(durable, timeout))

    on_durable = set(json.loads(await handoff.agree(listed)) or [])
    staged = await staged_everywhere(fast, handoff, host_view=True)
    waiting = [step for step in staged if step not in on_durable]
    if not waiting:
        return StagedSteps()
    step = waiting[-1]

    async def manifest_text() -> str:
        record = await read_staged(fast, step)
        if record is None or record.manifest_digest is None:
            raise CorruptCheckpointError(f"step {step} is no longer staged on {fast.url}")
        where = layout.AttemptDir(step, record.attempt)
        data = await fast.read(where.manifest)
        if digest(data) != record.manifest_digest:
            raise CorruptCheckpointError(f"{fast.url}/{where.manifest} is not the staged manifest")
        return data.decode()

    try:  # every process learns process 0's failure alike
        text = await handoff.agree(manifest_text)
        newest = Manifest.from_bytes(text.encode(), where=f"process 0's staged step {step}")
    except CorruptCheckpointError as exc:
        log.warning("ckptstore: staged step %d is not listed before its promotion: %s", step, exc)
        return StagedSteps(waiting)
    return StagedSteps(waiting, newest)
