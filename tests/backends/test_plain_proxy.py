"""Saves through a plain forwarding HTTP proxy in front of moto's S3 server land whole.

The proxy is what anyone writes in a few lines: Python's `ThreadingHTTPServer`, each
request body read by its ``Content-Length`` and sent on with `http.client`. It speaks
HTTP/1.1 (and then answers ``Expect: 100-continue`` itself) or HTTP/1.0 (and then cannot:
RFC 9110 10.1.1). Through both, a save whose pack (one PUT of 4 MiB, through the byte API)
and TensorStore leaf (through TensorStore's own S3 driver) cross the proxy restores
bit-exact.

The finding this keeps (issue 26): a pack "landing as 0 bytes" behind such a proxy was the
proxy's own doing. It answered each HEAD with ``Content-Length: 0``, the length of the body
it relayed (none) rather than the object's (RFC 9110 9.3.2, 8.6): the object was whole, the
stat through the proxy said 0 bytes, and the save's check of its packs refused to commit.
That check stays (a proxy that does this still gets a typed refusal and no committed
step). Separately, every PUT through an HTTP/1.0 proxy used to hang until the deadline:
botocore asks for ``Expect: 100-continue`` and aiohttp waits for the ``100`` with no timer;
the S3 backend no longer sends the header.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest

import ckptstore
from ckptstore.testing.servers import MotoS3Server

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "expect"}


@contextmanager
def plain_proxy(
    upstream: str, *, protocol: str = "HTTP/1.1", head_length_from_body: bool = False
) -> Iterator[tuple[str, list[tuple[str, str, dict[str, str], int]]]]:
    """A forwarding proxy to ``upstream`` (``http://host:port``): its endpoint and the
    requests it saw (method, path, headers, body bytes read). ``head_length_from_body``:
    the bug of the proxy in issue 26 (every reply's Content-Length is what it relays)."""
    host = upstream.removeprefix("http://")
    seen: list[tuple[str, str, dict[str, str], int]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = protocol

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length) if length else b""
            seen.append((self.command, self.path, dict(self.headers), len(body)))
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"
            }
            conn = http.client.HTTPConnection(host, timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
            finally:
                conn.close()
            self.send_response(reply.status)
            for k, v in reply.getheaders():
                if k.lower() in _HOP_BY_HOP:
                    continue
                if k.lower() == "content-length" and head_length_from_body:
                    continue
                self.send_header(k, v)
            if head_length_from_body or reply.getheader("Content-Length") is None:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def tree() -> dict[str, np.ndarray[Any, Any]]:
    """A 4 MiB leaf (packed: one PUT through the byte API) and a 6 MiB one (TensorStore)."""
    rng = np.random.default_rng(26)
    return {
        "packed": rng.standard_normal(1 << 20, dtype=np.float32),
        "chunked": rng.standard_normal(3 << 19, dtype=np.float64),
        "small": np.arange(7, dtype=np.int16),
    }


def profile(tmp_path: Path, endpoint: str, bucket: str) -> str:
    """A profile reaching ``bucket`` through ``endpoint``, with a short deadline: a hang
    through the proxy fails the test in seconds, not minutes."""
    path = tmp_path / "proxied.toml"
    path.write_text(
        f'url = "s3://{bucket}/run"\n[options]\nendpoint = "{endpoint}"\n'
        "[options.retry]\nmax_attempts = 2\ndeadline = 20.0\n"
    )
    return str(path)


def stored_size(server: MotoS3Server, bucket: str, suffix: str) -> int:
    """The size moto itself holds for the one object whose key ends in ``suffix``."""
    client = boto3.client("s3", endpoint_url=server.endpoint)
    (obj,) = [
        o for o in client.list_objects_v2(Bucket=bucket)["Contents"] if o["Key"].endswith(suffix)
    ]
    return int(obj["Size"])


@pytest.mark.parametrize("protocol", ["HTTP/1.1", "HTTP/1.0"])
def test_a_save_through_a_plain_proxy_lands_whole(
    protocol: str, ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str, tmp_path: Path
) -> None:
    state = tree()
    with plain_proxy(ckptstore_s3_server.endpoint, protocol=protocol) as (endpoint, seen):
        target = profile(tmp_path, endpoint, ckptstore_s3_bucket)
        ckptstore.save_sync(target, state, step=1)
        restored = ckptstore.restore_sync(target, step=1)
        assert ckptstore.verify_sync(target, step=1).ok
    for name, array in state.items():
        assert restored[name].dtype == array.dtype
        assert restored[name].tobytes() == array.tobytes(), name
    puts = [(path, n) for method, path, _, n in seen if method == "PUT"]
    (pack,) = [n for path, n in puts if path.endswith("/pack-0")]
    assert pack > 4 << 20  # the 4 MiB leaf crossed the proxy whole, in one PUT
    assert stored_size(ckptstore_s3_server, ckptstore_s3_bucket, "/pack-0") == pack
    agents = {h.get("User-Agent", "").split("/")[0] for m, _, h, _ in seen if m == "PUT"}
    assert "aiobotocore" in agents and any("tensorstore" in a.lower() for a in agents), agents
    # No byte-API request asks for a 100 (Continue) an HTTP/1.0 hop cannot send.
    assert not [
        p for m, p, h, _ in seen if "aiobotocore" in h.get("User-Agent", "") and "Expect" in h
    ]


def test_a_proxy_that_misreports_sizes_gets_no_commit(
    ckptstore_s3_server: MotoS3Server, ckptstore_s3_bucket: str, tmp_path: Path
) -> None:
    """The proxy of issue 26: a HEAD through it says 0 bytes. The object landed whole;
    the save cannot tell, so it refuses to commit, typed, naming the pack."""
    with plain_proxy(ckptstore_s3_server.endpoint, head_length_from_body=True) as (endpoint, _):
        target = profile(tmp_path, endpoint, ckptstore_s3_bucket)
        with pytest.raises(ckptstore.IncompleteCheckpointError, match="pack-0 holds 0 bytes"):
            ckptstore.save_sync(target, tree(), step=1)
        assert ckptstore.list_steps_sync(target) == []
