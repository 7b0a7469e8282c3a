"""A manager's "already committed?" check before a save is bounded: by ``ManagerOptions.
timeout`` on its target, and on a tiered target's durable tier by a short wait after which the
fast tier saves anyway (`ckptstore.lifecycle.existence`). Against moto's S3 server behind a
`FaultProxy` that stops answering, or answers 503 to everything."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.s3 import S3Backend
from ckptstore.errors import AlreadyExistsError, RetriesExhaustedError
from ckptstore.testing.faultproxy import Fault, FaultProxy
from tests.tiers.helpers import impatient_s3

TREE = {"w": np.arange(4096.0, dtype=np.float32), "n": 3}
#: Seconds a check may take against a dead endpoint here (generous: a loaded machine).
BOUND = 15.0


def _options(timeout: float) -> ckptstore.ManagerOptions:
    return ckptstore.ManagerOptions(timeout=timeout, gc_on_start=False, handle_sigterm=False)


def test_a_hanging_store_fails_the_check_within_the_managers_timeout(
    ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    with FaultProxy(endpoint) as proxy:
        backend = S3Backend(
            ckptstore_s3_bucket, "run", endpoint_url=proxy.endpoint, credentials="env"
        )  # its own retry policy: the default, minutes against a black hole
        with ckptstore.CheckpointManager(backend, options=_options(2.0)) as mgr:
            proxy.set_faults(Fault("blackhole", rate=1.0))
            start = time.monotonic()
            with pytest.raises(RetriesExhaustedError, match=r"step 2 is committed.*2 s"):
                mgr.save(2, TREE, force=True)
            assert time.monotonic() - start < BOUND
            assert proxy.injected["blackhole"] > 0
            proxy.set_faults()


@pytest.mark.parametrize(
    "fault", [Fault("blackhole", rate=1.0), Fault("status", rate=1.0)], ids=["blackhole", "503"]
)
def test_a_tiered_save_goes_to_the_fast_tier_while_the_durable_tier_is_down(
    tmp_path: Path,
    ckptstore_s3_server: object,
    ckptstore_s3_bucket: str,
    fault: Fault,
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    with FaultProxy(endpoint) as proxy:
        durable = impatient_s3(ckptstore_s3_bucket, proxy.endpoint)
        tiered = ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=durable)
        mgr = ckptstore.CheckpointManager(tiered, options=_options(60.0))
        try:
            proxy.set_faults(fault)
            start = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="ckptstore"):
                handle = mgr.save(2, TREE, force=True)
            assert time.monotonic() - start < BOUND
            assert handle is not None
            assert "durable tier did not say whether step 2" in caplog.text
            assert proxy.injected[fault.kind] > 0
            handle.wait()  # committed on the fast tier
            assert ckptstore.list_steps_sync(str(tmp_path / "nvme")) == [2]
        finally:
            proxy.set_faults()
            mgr.close()
    got = ckptstore.restore_sync(str(tmp_path / "nvme"), 2)
    np.testing.assert_array_equal(got["w"], TREE["w"])


def test_a_step_committed_on_the_durable_tier_alone_is_still_refused(
    tmp_path: Path, ckptstore_s3_server: object, ckptstore_s3_bucket: str
) -> None:
    endpoint = ckptstore_s3_server.endpoint  # type: ignore[attr-defined]
    durable = S3Backend(ckptstore_s3_bucket, "run", endpoint_url=endpoint, credentials="env")
    ckptstore.save_sync(durable, TREE, step=3)
    tiered = ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=durable)
    with ckptstore.CheckpointManager(tiered, options=_options(60.0)) as mgr:
        with pytest.raises(AlreadyExistsError, match="step 3"):
            mgr.save(3, TREE, force=True)
