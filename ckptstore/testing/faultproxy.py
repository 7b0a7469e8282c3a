"""A fault-injecting HTTP reverse proxy, for faults on the whole data path.

`FaultyBackend` fails calls of the byte API only; TensorStore's own s3/gcs drivers
talk HTTP to the server directly. Put a `FaultProxy` in front of moto's S3 server or
fake-gcs-server (or any HTTP endpoint) and point every client at `FaultProxy.endpoint`
(``endpoint_url=`` for the backends, ``$TENSORSTORE_GCS_HTTP_URL`` for TensorStore's
GCS driver): then s3fs, gcsfs and TensorStore requests alike meet the faults.

A `Fault` says what goes wrong (`KINDS`), to which requests (``methods``, a ``path``
or ``agent`` regex) and when: on the ``nth`` matching requests, or at a seeded
``rate``. The proxy runs its own event loop in a daemon thread, so synchronous and
asynchronous tests (and ``python -m ckptstore.testing.faultproxy``) can use it alike.
Request and reply bodies are buffered whole: meant for test-sized objects, not TiBs.

With ``rate_limit_bytes_per_s`` the proxy is also a slow link: request and reply bodies
pass through one token bucket shared by every connection and both directions, so the
bytes of all bodies together never go faster than that rate (`RateLimit`). A benchmark
then sees what compression buys on a link slower than the disk or CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Self

import aiohttp
from aiohttp import web
from yarl import URL

FaultKind = Literal["status", "drop", "lost_reply", "truncate", "latency", "blackhole"]
#: What each kind does to a request it hits.
KINDS: dict[str, str] = {
    "status": "answer `status` (default 503) at once; the request never reaches the server",
    "drop": "close the connection without an answer; the request never reaches the server",
    "lost_reply": "forward the request, then close the connection: it took effect, unseen",
    "truncate": "forward, then send the reply's headers and half its body, and close",
    "latency": "wait `delay` seconds, then forward",
    "blackhole": "accept the request and never answer (until the client gives up)",
}

#: Headers that belong to one connection, never forwarded (RFC 9110 7.6.1), plus the
#: ones aiohttp recomputes for the body it sends.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",
    }
)
_S3_CODES = {
    403: "AccessDenied",
    404: "NoSuchKey",
    429: "SlowDown",
    500: "InternalError",
    503: "SlowDown",
}


@dataclass(frozen=True)
class Fault:
    """One rule: what goes wrong (``kind``, see `KINDS`), for which requests, and when.

    A request matches if its method is in ``methods`` (any when None) and the regexes
    ``path`` (on the path and query) and ``agent`` (on the User-Agent header) are found
    in it. A matching request is hit if its 1-based number among the matches is in
    ``nth``, or else with probability ``rate`` (from the proxy's seeded generator), at
    most ``limit`` times in all. The first rule that hits a request decides its fate.
    """

    kind: FaultKind
    rate: float = 0.0
    nth: frozenset[int] = frozenset()
    status: int = 503
    delay: float = 0.0
    methods: frozenset[str] | None = None
    path: str | None = None
    agent: str | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {sorted(KINDS)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")
        if not 100 <= self.status <= 599:
            raise ValueError(f"fault status must be an HTTP status, got {self.status}")
        object.__setattr__(self, "nth", frozenset(self.nth))
        if self.methods is not None:
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))

    def matches(self, method: str, path: str, agent: str) -> bool:
        return (
            (self.methods is None or method in self.methods)
            and (self.path is None or re.search(self.path, path) is not None)
            and (self.agent is None or re.search(self.agent, agent) is not None)
        )


class RateLimit:
    """A token bucket: `take` returns once ``n`` more bytes fit under ``rate`` bytes/s.

    One bucket serves every connection of a proxy and both directions (a half-duplex
    link: request bodies upstream and reply bodies downstream share the rate). Takers
    queue in arrival order (an `asyncio.Lock`), and a take may run into debt that the
    next taker waits out, so chunks of any size keep the long-run rate exact; ``burst``
    bytes may pass at once after an idle spell. Used on the proxy's event loop only.
    """

    #: Bytes per take: small enough that concurrent transfers interleave finely.
    CHUNK = 64 * 1024

    def __init__(self, rate: float, burst: int | None = None) -> None:
        if not rate > 0:
            raise ValueError(f"rate limit must be positive bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(self.CHUNK if burst is None else burst)
        self._tokens = self.burst
        self._stamp = time.monotonic()
        self._lock: asyncio.Lock | None = None
        self.passed = 0  # bytes let through so far

    async def take(self, n: int) -> None:
        if self._lock is None:  # made on the loop that uses it
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            self.passed += n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)


@dataclass
class Seen:
    """One request the proxy received: when, what, from whom, the fault (if any), and when
    its reply was ready (None while it runs, and for a request cut off)."""

    at: float  # time.monotonic() on arrival
    method: str
    path: str
    agent: str
    fault: str | None
    done: float | None = None


def serial_chain(seen: Sequence[Seen]) -> list[Seen]:
    """The longest chain of ``seen`` requests each of which arrived after the one before
    it had its reply: how many round trips one after another they took, at the least
    (requests that overlap in time were issued together, so none waited for the other).
    With a ``latency`` fault on every request, each lasts at least its delay, and the
    chain is the requests' critical path."""
    ended = sorted((s for s in seen if s.done is not None), key=lambda s: s.at)
    best: list[list[Seen]] = []  # best[i]: the longest chain ending with ended[i]
    for i, s in enumerate(ended):
        before = [best[j] for j in range(i) if (ended[j].done or 0.0) <= s.at]
        best.append([*max(before, key=len, default=[]), s])
    return max(best, key=len, default=[])


@dataclass
class _Rule:
    fault: Fault
    matched: int = 0
    hits: int = 0


@dataclass
class _State:
    rules: list[_Rule] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)


class FaultProxy:
    """A reverse proxy to ``upstream`` that injects `Fault` rules; start it, then use
    `endpoint`. Rules can be replaced at any time (`set_faults`), from any thread."""

    def __init__(
        self,
        upstream: str,
        faults: Iterable[Fault] = (),
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        rate_limit_bytes_per_s: float | None = None,
    ):
        """``rate_limit_bytes_per_s``: cap the bodies of all requests and replies together
        at this many bytes per second (`RateLimit`); None: as fast as the proxy goes."""
        self.upstream = upstream.rstrip("/")
        self._limit = None if rate_limit_bytes_per_s is None else RateLimit(rate_limit_bytes_per_s)
        self.host, self._port = host, port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._state = _State(rules=[_Rule(f) for f in faults])
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None
        self._failed: BaseException | None = None

    # ---- configuration and observation (any thread) ----

    @property
    def endpoint(self) -> str:
        """``http://HOST:PORT`` of the proxy; only valid while started."""
        if self._thread is None:
            raise RuntimeError("FaultProxy is not started")
        return f"http://{self.host}:{self._port}"

    def set_faults(self, *faults: Fault) -> None:
        """Replace every rule (counts start afresh); no argument: pass everything through."""
        with self._lock:
            self._state.rules = [_Rule(f) for f in faults]

    @property
    def seen(self) -> list[Seen]:
        """Every request received so far, in order of arrival."""
        with self._lock:
            return list(self._state.seen)

    @property
    def injected(self) -> Counter[str]:
        """How many faults of each kind were injected so far."""
        with self._lock:
            return Counter(self._state.injected)

    @property
    def limited_bytes(self) -> int:
        """Body bytes that passed the rate limit so far, both directions (0 without one)."""
        return 0 if self._limit is None else self._limit.passed

    def reset_counts(self) -> None:
        """Forget the requests seen and the faults injected (the rules stay)."""
        with self._lock:
            self._state.seen.clear()
            self._state.injected.clear()

    def _decide(self, method: str, path: str, agent: str) -> tuple[Fault | None, Seen]:
        with self._lock:
            chosen = None
            for rule in self._state.rules:
                if not rule.fault.matches(method, path, agent):
                    continue
                rule.matched += 1
                f = rule.fault
                if chosen is not None or (f.limit is not None and rule.hits >= f.limit):
                    continue
                if rule.matched in f.nth or (f.rate > 0 and self._rng.random() < f.rate):
                    rule.hits += 1
                    chosen = f
            name = None
            if chosen is not None:
                name = f"status {chosen.status}" if chosen.kind == "status" else chosen.kind
                self._state.injected[chosen.kind] += 1
            seen = Seen(time.monotonic(), method, path, agent, name)
            self._state.seen.append(seen)
            return chosen, seen

    def _done(self, seen: Seen) -> None:
        with self._lock:
            seen.done = time.monotonic()

    # ---- lifecycle ----

    def start(self) -> None:
        """Start serving in a daemon thread; returns once the port is bound."""
        if self._thread is not None:
            return
        ready = threading.Event()
        thread = threading.Thread(target=self._run, args=(ready,), name="faultproxy", daemon=True)
        self._thread = thread
        thread.start()
        ready.wait()
        if self._failed is not None:
            self._thread = None
            thread.join()
            raise RuntimeError(f"fault proxy could not start: {self._failed}") from self._failed

    def stop(self) -> None:
        """Stop serving: black-holed requests are cut, the thread ends."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = self._loop = None

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

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            runner, session = loop.run_until_complete(self._serve())
        except BaseException as exc:  # a taken port, say: reported by `start`
            self._failed = exc
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            assert self._closing is not None
            self._closing.set()
            loop.run_until_complete(runner.cleanup())
            loop.run_until_complete(session.close())
            loop.close()

    async def _serve(self) -> tuple[web.AppRunner, aiohttp.ClientSession]:
        self._closing = asyncio.Event()
        session = aiohttp.ClientSession(
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._session = session
        app = web.Application(client_max_size=1 << 40)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._port)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        self._port = server.sockets[0].getsockname()[1]
        return runner, session

    # ---- one request ----

    async def _read_body(self, request: web.Request) -> bytes:
        """The request's body, paced by the rate limit when there is one."""
        if self._limit is None:
            return await request.read()
        parts = []
        while chunk := await request.content.read(RateLimit.CHUNK):
            await self._limit.take(len(chunk))
            parts.append(chunk)
        return b"".join(parts)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        agent = request.headers.get("User-Agent", "")
        fault, seen = self._decide(request.method, request.raw_path, agent)
        reply = await self._reply(request, body, fault)
        if fault is None or fault.kind in ("status", "latency"):  # answered in full
            self._done(seen)
        return reply

    async def _reply(
        self, request: web.Request, body: bytes, fault: Fault | None
    ) -> web.StreamResponse:
        kind = fault.kind if fault is not None else None
        if fault is not None and fault.kind == "status":
            return _error_reply(fault.status, request.raw_path)
        if kind == "drop":
            return await _cut(request)
        if kind == "blackhole":
            assert self._closing is not None
            await self._closing.wait()
            return await _cut(request)
        if fault is not None and fault.kind == "latency":
            await asyncio.sleep(fault.delay)
        status, headers, data = await self._forward(request, body)
        if kind == "lost_reply":
            return await _cut(request)
        if kind == "truncate" and len(data) > 1:
            reply = web.StreamResponse(status=status, headers=headers)
            reply.content_length = len(data)
            await reply.prepare(request)
            await reply.write(data[: len(data) // 2])
            return await _cut(request)
        if self._limit is not None and data:
            reply = web.StreamResponse(status=status, headers=headers)
            reply.content_length = len(data)
            await reply.prepare(request)
            for at in range(0, len(data), RateLimit.CHUNK):
                chunk = data[at : at + RateLimit.CHUNK]
                await self._limit.take(len(chunk))
                await reply.write(chunk)
            await reply.write_eof()
            return reply
        reply = web.Response(status=status, headers=headers, body=data or None)
        if "Content-Length" in headers:  # a HEAD reply's length describes the object
            reply.headers["Content-Length"] = headers["Content-Length"]
        return reply

    async def _forward(
        self, request: web.Request, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        url = URL(self.upstream + request.raw_path, encoded=True)
        try:
            async with self._session.request(
                request.method, url, headers=headers, data=body, allow_redirects=False
            ) as resp:
                data = await resp.read()
                out = {}
                for k, v in resp.headers.items():
                    if k.lower() in _HOP_BY_HOP - {"content-length"}:
                        continue
                    if k.lower() == "location" and v.startswith(self.upstream):
                        v = f"{self.endpoint}{v[len(self.upstream) :]}"
                    out[k] = v
                return resp.status, out, data
        except (aiohttp.ClientError, OSError):
            return 502, {}, b""  # the server itself is unreachable: say so, as a gateway does


def _error_reply(status: int, path: str) -> web.Response:
    """An error reply the client parses as its service's own (GCS JSON, else S3 XML)."""
    message = f"injected by FaultProxy: {status}"
    if path.startswith(("/storage/", "/upload/", "/download/")):
        doc = {"error": {"code": status, "message": message}}
        return web.Response(status=status, text=json.dumps(doc), content_type="application/json")
    code = _S3_CODES.get(status, "ServiceUnavailable" if status >= 500 else "InvalidRequest")
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    )
    return web.Response(status=status, text=xml, content_type="application/xml")


async def _cut(request: web.Request) -> web.StreamResponse:
    """Close the client's connection at once, with no (further) reply."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    raise asyncio.CancelledError  # aiohttp ends the handler quietly; nothing more is sent


# ---- command line ----


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    kinds = "\n".join(f"  {k:10}  {v}" for k, v in KINDS.items())
    parser = argparse.ArgumentParser(
        prog="python -m ckptstore.testing.faultproxy",
        description="A fault-injecting reverse proxy to an HTTP object store (one rule).",
        epilog=f"fault kinds:\n{kinds}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("upstream", help="the server's URL, e.g. http://127.0.0.1:9000")
    parser.add_argument("--port", type=int, default=0, help="listen port (default: any free)")
    parser.add_argument("--kind", choices=sorted(KINDS), default="status")
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--nth", default="", help="comma-separated request numbers")
    parser.add_argument("--status", type=int, default=503)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--method", action="append", help="only these methods (repeatable)")
    parser.add_argument("--path", help="only paths matching this regex")
    parser.add_argument("--agent", help="only User-Agents matching this regex")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rate-limit",
        type=float,
        help="cap all bodies, both directions together, at this many bytes/s (e.g. 100e6)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until interrupted, printing the endpoint first."""
    args = _parse_args(argv)
    fault = Fault(
        args.kind,
        rate=args.rate,
        nth=frozenset(int(n) for n in args.nth.split(",") if n),
        status=args.status,
        delay=args.delay,
        methods=frozenset(args.method) if args.method else None,
        path=args.path,
        agent=args.agent,
    )
    with FaultProxy(
        args.upstream,
        [fault],
        seed=args.seed,
        port=args.port,
        rate_limit_bytes_per_s=args.rate_limit,
    ) as proxy:
        print(proxy.endpoint, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
