"""Figures for faults on the data path (docs/reliability.md, "Faults on the data path").

Through `FaultProxy`, a fraction of *all* requests (the byte API's and TensorStore's
alike) fails transiently: 503, 500 or 429 answers and dropped connections, none of which
reached the server. Saves, partial saves and restores on moto S3 and fake-gcs-server must
still succeed bit-exact. With permanent faults (every data write refused or unavailable)
they must fail with a typed error and commit nothing.

The default run is one round per store; the figures in the docs come from a larger one:

    CKPTSTORE_FAULT_ROUNDS=20 CKPTSTORE_FAULT_RATE=0.1 \\
        .venv/bin/python -m pytest -q -s tests/campaigns/test_fault_campaign.py

which prints, per store, the rounds, the requests seen and the faults injected.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import TransientStorageError
from ckptstore.testing.faultproxy import Fault, FaultProxy
from tests.bits import same

ROUNDS = int(os.environ.get("CKPTSTORE_FAULT_ROUNDS", "1"))
RATE = float(os.environ.get("CKPTSTORE_FAULT_RATE", "0.1"))
SEED = int(os.environ.get("CKPTSTORE_FAULT_SEED", "0"))
#: At 10% failures, 8 attempts leave a request failing for good with odds 1e-8.
POLICY = RetryPolicy(max_attempts=8, base_delay=0.005, max_delay=0.05)
#: For permanent faults: retrying longer would change nothing but the test's duration.
SHORT = RetryPolicy(max_attempts=2, base_delay=0.005, max_delay=0.01)
WRITES = frozenset({"PUT", "POST"})

Store = tuple[FaultProxy, Callable[[RetryPolicy], Backend]]


def transient(rate: float) -> list[Fault]:
    """About ``rate`` of all requests fail, in four ways, before reaching the server."""
    each = rate / 4
    return [
        Fault("status", status=503, rate=each),
        Fault("status", status=500, rate=each),
        Fault("status", status=429, rate=each),
        Fault("drop", rate=each),
    ]


@pytest.fixture(params=["s3", "gcs"])
def store(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FaultProxy, Callable[[RetryPolicy], Backend]]]:
    """A proxy in front of the emulator, and a maker of backends using it."""
    kind = request.param
    server = request.getfixturevalue(
        "ckptstore_s3_server" if kind == "s3" else "ckptstore_gcs_server"
    )
    bucket = request.getfixturevalue(
        "ckptstore_s3_bucket" if kind == "s3" else "ckptstore_gcs_bucket"
    )
    with FaultProxy(server.endpoint, seed=SEED) as proxy:

        def make(retry: RetryPolicy) -> Backend:
            if kind == "s3":
                return S3Backend(
                    bucket, "run", endpoint_url=proxy.endpoint, credentials="env", retry=retry
                )
            return GcsBackend(
                bucket,
                "run",
                endpoint_url=proxy.endpoint,
                credentials="anonymous",
                retry=retry,
                emulator=True,
            )

        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.endpoint)
        yield proxy, make


def tree(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    w = rng.standard_normal((128, 64)).astype(np.float32)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),  # 8 chunks
            "b": rng.standard_normal(300).astype(np.float16),
            "big": rng.integers(0, 255, 300_000, dtype=np.uint8),
        },
        "step": seed,
    }


def split(proxy: FaultProxy) -> dict[str, Counter[str]]:
    """Requests seen and faults injected, for the byte API and for TensorStore."""
    out: dict[str, Counter[str]] = {"byte API": Counter(), "TensorStore": Counter()}
    for s in proxy.seen:
        side = out["TensorStore" if s.agent.startswith("tensorstore") else "byte API"]
        side["requests"] += 1
        if s.fault:
            side[s.fault] += 1
    return out


async def test_transient_faults_everywhere_are_survived(store: Store) -> None:
    proxy, make = store
    async with make(POLICY) as backend:
        proxy.set_faults(*transient(RATE))
        for r in range(ROUNDS):
            expected = tree(r)
            await ckptstore.save(backend, expected, step=2 * r)
            assert same(await ckptstore.restore(backend, step=2 * r), expected)

            session = await ckptstore.partial_save(backend, step=2 * r + 1)
            await session.add({"params": expected["params"]})
            await session.add({"step": expected["step"]})
            await session.finalize()
            assert same(await ckptstore.restore(backend, step=2 * r + 1), expected)
        counts = split(proxy)
        proxy.set_faults()
        assert await ckptstore.list_steps(backend) == list(range(2 * ROUNDS))
    injected = sum(proxy.injected.values())
    print(
        f"\n{backend.kind}: {ROUNDS} round(s) of save + restore + partial save (2 parts) + "
        f"restore at {RATE:.0%} transient faults: "
        + "; ".join(f"{side} {dict(c)}" for side, c in counts.items())
    )
    ts_faults = sum(counts["TensorStore"].values()) - counts["TensorStore"]["requests"]
    if RATE >= 0.05:  # TensorStore's requests (a hundred or more a round) were not spared
        assert injected > 0 and ts_faults > 0, counts


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (Fault("status", status=503, rate=1.0, methods=WRITES), TransientStorageError),
        (Fault("drop", rate=1.0, methods=WRITES, agent="^tensorstore"), TransientStorageError),
    ],
    ids=["503", "drop-tensorstore"],  # 403: test_datapath_faults.py
)
async def test_permanent_faults_commit_nothing(
    store: Store, fault: Fault, error: type[Exception]
) -> None:
    proxy, make = store
    async with make(SHORT) as backend:
        await ckptstore.save(backend, tree(0), step=0)
        session = await ckptstore.partial_save(backend, step=2)
        await session.add({"params": tree(2)["params"]})
        proxy.set_faults(fault)
        with pytest.raises(error):
            await ckptstore.save(backend, tree(1), step=1)
        with pytest.raises(error):
            await session.add({"step": 2})
        with pytest.raises(error):
            await session.finalize()
        proxy.set_faults()
        assert await ckptstore.list_steps(backend) == [0]
        assert same(await ckptstore.restore(backend, step=0), tree(0))
