"""How many round trips one after another a small save takes on object storage: every
request through a `FaultProxy` that delays each by `DELAY`, the save's requests' critical
path (`serial_chain`) counted, on moto's S3 server and fake-gcs-server.

On a real object store every serial request costs tens of milliseconds, so a small save's
time to committed is its count of serial round trips (docs/architecture.md, "Round trips
of a save"). The test fails when the count grows past today's (`MOST`).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

import ckptstore
from ckptstore.testing.faultproxy import Fault, FaultProxy, Seen, serial_chain
from tests.campaigns.proxied import Make

#: Today's serial round trips of `small_tree`'s save, per scheme: the pack of the small
#: leaves (the step's markers listed beside it: is it committed?), the process store's
#: OCDBT manifest read, the item store's (read, checked, written: the merge, the pack
#: checked beside it), the manifest (the markers listed beside it), the marker created, its
#: revocation looked for (GCS adds the fate record's write). Lower them as the protocol
#: takes fewer (issue: 6 at the most).
MOST = {"s3": 9, "gs": 10}

#: Each request's added delay: long beside the emulators' own times and the scheduling of
#: requests issued together, so that only a request that waited for another follows it.
DELAY = 0.1


def small_tree() -> dict[str, np.ndarray]:
    """1 MiB in 10 leaves."""
    return {f"w{i}": np.full((256, 102), i, np.float32) for i in range(10)}


def describe(chain: list[Seen]) -> str:
    return "\n".join(f"  {s.method} {s.path.split('?')[0]} ({s.agent[:12]})" for s in chain)


async def counted_save(proxy: FaultProxy, make: Make, step: int) -> tuple[str, list[Seen], float]:
    """One save of `small_tree` through the delaying proxy: the backend's scheme, every
    request the save made, and the seconds from call to committed."""
    backend = make()
    try:
        await ckptstore.save(backend, small_tree(), step=step)  # warm: clients, buckets
        proxy.set_faults(Fault("latency", rate=1.0, delay=DELAY))
        proxy.reset_counts()
        start = time.perf_counter()
        await ckptstore.save(backend, small_tree(), step=step + 1)
        took = time.perf_counter() - start
        proxy.set_faults()
    finally:
        await backend.close()
    return backend.url.split(":")[0], proxy.seen, took


def test_serial_round_trips_of_a_small_save(behind_proxy: tuple[FaultProxy, Make]) -> None:
    proxy, make = behind_proxy
    scheme, seen, took = asyncio.run(counted_save(proxy, make, 1))
    chain = serial_chain(seen)
    if len(chain) > MOST[scheme]:  # a stall on a loaded machine can split two at once
        scheme, seen, took = asyncio.run(counted_save(proxy, make, 3))
        chain = min(chain, serial_chain(seen), key=len)
    print(f"\n{len(seen)} requests, {len(chain)} serial, {took:.2f} s:\n{describe(chain)}")
    assert len(chain) <= MOST[scheme], describe(chain)
    assert took >= len(chain) * DELAY  # the delay was on every request of the chain
