"""Operations against stores whose TensorStore requests never get an answer
(tests/campaigns/test_timeouts.py).

Run as ``python tests/campaigns/timeout_worker.py MODE '<json list of stores>'``, with
``$TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS`` set: TensorStore reads its stall timeout
once per process, hence a process of its own. Each store is ``{"kind", "bucket",
"endpoint"}``. MODE ``kv``: one read and one write through the backend's TensorStore
kvstore (no jax: a quick process). MODE ``save``: save, restore and verify (step 1 must
be committed), then list the steps. Prints one JSON line per store and operation:
``{"store", "op", "error", "typed", "seconds", ...}``; "error" is the exception's class
(null if none).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import tensorstore as ts

from ckptstore.backends.base import Backend
from ckptstore.backends.gcs import GcsBackend
from ckptstore.backends.retry import RetryPolicy
from ckptstore.backends.s3 import S3Backend
from ckptstore.backends.tserrors import write_error
from ckptstore.datapath.reads import read_error
from ckptstore.errors import CkptStoreError

POLICY = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.05)


def backend(store: dict[str, str]) -> Backend:
    if store["kind"] == "s3":
        return S3Backend(
            store["bucket"], "run", endpoint_url=store["endpoint"], credentials="env", retry=POLICY
        )
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = store["endpoint"]
    return GcsBackend(
        store["bucket"],
        "run",
        endpoint_url=store["endpoint"],
        credentials="anonymous",
        retry=POLICY,
    )


async def one(mode: str, store: dict[str, str]) -> None:
    async def timed(op: str, work: Any) -> Any:
        start = time.monotonic()
        result, error = None, None
        try:
            result = await work
        except Exception as exc:
            error = exc
        line: dict[str, Any] = {
            "store": store["kind"],
            "op": op,
            "error": type(error).__name__ if error is not None else None,
            "typed": isinstance(error, CkptStoreError),
            "seconds": round(time.monotonic() - start, 2),
            "message": str(error)[:300] if error is not None else None,
        }
        if op == "verify" and result is not None:
            line["unreadable"] = len(result.unreadable)
            line["problems"] = len(result.problems)
        if op == "list_steps":
            line["steps"] = result
        print(json.dumps(line), flush=True)
        return result

    async with backend(store) as b:
        if mode == "kv":
            kv = await ts.KvStore.open(b.kvstore_spec("kv"), context=b.ts_context)

            async def read() -> Any:
                try:
                    return await kv.read("key")
                except ValueError as exc:
                    raise read_error(exc, "key") from exc

            async def write() -> Any:
                try:
                    return await kv.write("key", b"value")
                except ValueError as exc:
                    raise write_error(exc, "key") from exc

            await asyncio.gather(timed("read", read()), timed("write", write()))
            return
        import numpy as np

        import ckptstore

        await timed("save", ckptstore.save(b, {"x": np.arange(1000.0)}, step=2))
        await timed("restore", ckptstore.restore(b, step=1))
        await timed("verify", ckptstore.verify(b, step=1))
        await timed("list_steps", ckptstore.list_steps(b))


async def main(mode: str, stores: list[dict[str, str]]) -> None:
    if mode == "kv":  # quick: every store at once
        await asyncio.gather(*(one(mode, store) for store in stores))
    else:
        for store in stores:
            await one(mode, store)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
