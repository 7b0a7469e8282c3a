"""Google Cloud Storage backend on gcsfs.

gcsfs supplies credentials (application default, service-account file or
anonymous) and the aiohttp session; the operations speak the GCS JSON API
directly through that session so that every status code reaches one error
mapping and no hidden retry loop (gcsfs retries 6 times with up to 32 s
sleeps) runs under our `RetryPolicy`.

``create`` uploads with ``ifGenerationMatch=0``: the server refuses (412) if
the object exists. fake-gcs-server ignores preconditions, so in emulator mode
``create`` also checks for the key first and the backend reports
``capabilities.conditional_create = False``: racing creators can both "win"
there, never on real GCS. Emulator mode is explicit (``emulator=True``, or the
endpoint is ``$STORAGE_EMULATOR_HOST``, the variable's documented meaning): any
other endpoint (a proxy, a private gateway) keeps real credentials and the
server-decided create.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import google.auth.exceptions
from gcsfs.retry import HttpError, NonRetryableError

from ckptstore.backends import gcscreds
from ckptstore.backends._errors import (
    already_exists,
    error_for,
    redact_url,
    transport_error,
    transport_errors,
)
from ckptstore.backends.base import Capabilities, ObjectInfo, as_bytes_view
from ckptstore.backends.endpoints import check_endpoint
from ckptstore.backends.keys import dir_prefix, join, validate_prefix
from ckptstore.backends.objectstore import (
    CONNECT_TIMEOUT,
    READ_TIMEOUT,
    ObjectStoreBackend,
    RangeReply,
    parse_content_range,
    replaced,
)
from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import ConfigError, CredentialsError, NotFoundError
from ckptstore.runtime.futures import gather_first_error

MiB = 1 << 20
CHUNK_ALIGN = 256 * 1024  # resumable-upload chunks are multiples of 256 KiB
READ_PART_SIZE = 32 * MiB  # ranged GETs of large reads (docs/benchmarks.md)
READ_CONCURRENCY = 8
TS_REQUEST_CONCURRENCY: int | None = None  # TensorStore's gcs_request_concurrency
GCS_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
TENSORSTORE_ENV = "TENSORSTORE_GCS_HTTP_URL"
_TRANSIENT: tuple[type[BaseException], ...] = (
    *transport_errors(),
    google.auth.exceptions.TransportError,  # a token refresh that could not reach the server
)


def _normalize_endpoint(url: str, field: str) -> str:
    """``url`` checked (`check_endpoint`: a scheme-less ``host[:port]`` is ``http://``),
    without a trailing ``/``; `ConfigError` naming ``field`` if it is no endpoint."""
    return check_endpoint(url, field, bare_host=True)


class GcsBackend(ObjectStoreBackend):
    """Objects under ``gs://bucket/prefix``.

    ``credentials`` is ``"default"`` (application default credentials), ``"anonymous"`` or
    the path of a service-account JSON file. ``endpoint_url`` defaults to
    ``$STORAGE_EMULATOR_HOST`` when that is set. ``emulator``: whether the endpoint is an
    emulator (requests anonymous, so real tokens are never sent to one; ``create`` checks
    first, as emulators ignore preconditions); None means exactly when the endpoint is
    ``$STORAGE_EMULATOR_HOST``. Objects of at least ``resumable_threshold`` bytes go up as
    resumable uploads in ``chunk_size`` chunks; smaller ones in one request. Chunks go up
    one after another, each waiting for the server's answer, so fewer, larger chunks mean
    fewer round trips (Google's own client uses 100 MiB; chunks are sliced from the caller's
    buffer, not copied). Reads of more than ``read_part_size`` bytes are ranged GETs of that
    size, at most ``read_concurrency`` beyond each read's first in flight (see
    `objectstore`).
    ``connect_timeout`` and ``read_timeout`` (seconds) end a stalled request.
    """

    kind = "gcs"
    ts_concurrency_resource = "gcs_request_concurrency"
    ts_retries_resource = "gcs_request_retries"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        project: str | None = None,
        credentials: str = "default",
        concurrency: int = 32,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen, immutable
        resumable_threshold: int = 64 * MiB,
        chunk_size: int = 64 * MiB,
        read_part_size: int = READ_PART_SIZE,
        read_concurrency: int = READ_CONCURRENCY,
        ts_request_concurrency: int | None = TS_REQUEST_CONCURRENCY,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        emulator: bool | None = None,
    ):
        super().__init__(
            retry=retry,
            concurrency=concurrency,
            read_part_size=read_part_size,
            read_concurrency=read_concurrency,
            ts_request_concurrency=ts_request_concurrency,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        if not bucket or "/" in bucket:
            raise ConfigError(f"invalid GCS bucket name {bucket!r}")
        if chunk_size <= 0 or chunk_size % CHUNK_ALIGN:
            raise ConfigError(
                f"GCS chunk_size must be a positive multiple of 256 KiB: {chunk_size}"
            )
        if credentials not in ("default", "anonymous") and not os.path.isfile(credentials):
            looks_like_path = "/" in credentials and not set('{}\n"') & set(credentials)
            shown = repr(credentials) if looks_like_path else "(not shown: it may be a secret)"
            raise ConfigError(
                "GCS credentials must be 'default', 'anonymous' or the path of a "
                f"service-account JSON file; no such file: {shown}"
            )
        self.bucket = bucket
        self.root = validate_prefix(prefix)
        emulator_host = os.environ.get(EMULATOR_ENV, "default")
        env_endpoint = None if emulator_host in ("", "default") else emulator_host
        field = "GCS option 'endpoint'"
        if endpoint_url is None:
            endpoint_url = env_endpoint  # as gcsfs and google-cloud-storage do
            field = f"${EMULATOR_ENV}"
        self.endpoint_url = _normalize_endpoint(endpoint_url, field) if endpoint_url else None
        self.emulated = self._emulated(emulator, env_endpoint)
        self.project = project
        self.credentials = credentials
        self.resumable_threshold = resumable_threshold
        self.chunk_size = chunk_size
        self.capabilities = Capabilities(
            atomic_rename=False,
            conditional_create=not self.emulated,
            server_side_copy=True,
            durable_writes=True,
        )
        self._location = self.endpoint_url or GCS_ENDPOINT
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
        )
        self._fs: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fs_lock: asyncio.Lock | None = None

    def _emulated(self, emulator: bool | None, env_endpoint: str | None) -> bool:
        """Emulator mode: as asked, else whether the endpoint is ``$STORAGE_EMULATOR_HOST``."""
        if emulator is None:
            return env_endpoint is not None and self.endpoint_url == _normalize_endpoint(
                env_endpoint, f"${EMULATOR_ENV}"
            )
        if not isinstance(emulator, bool):
            raise ConfigError(f"GCS emulator must be true or false, got {emulator!r}")
        if emulator:
            host = urlsplit(self.endpoint_url).hostname if self.endpoint_url else None
            if host is None or host.endswith("googleapis.com"):
                shown = redact_url(self.endpoint_url or GCS_ENDPOINT)
                raise ConfigError(
                    f"gs://{self.bucket}: emulator mode needs the emulator's endpoint "
                    f"(endpoint, or ${EMULATOR_ENV}); got {shown}"
                )
        return emulator

    # ---- identity ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{self.root}" if self.root else f"gs://{self.bucket}"

    @property
    def location(self) -> str:
        return f"{self.endpoint_url or 'default'}|{self.url}"

    def __repr__(self) -> str:
        where = f" endpoint={redact_url(self.endpoint_url)}" if self.endpoint_url else ""
        source = self.credentials if self.credentials in ("default", "anonymous") else "file"
        mode = " emulator" if self.emulated else ""
        return f"<GcsBackend {self.url}{where}{mode} credentials={source}>"

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        """The TensorStore ``gcs`` spec for ``prefix``.

        TensorStore takes its endpoint from ``$TENSORSTORE_GCS_HTTP_URL`` and its
        credentials from the environment (``GOOGLE_APPLICATION_CREDENTIALS`` or
        gcloud's application default credentials), not from the spec. So for an
        emulator endpoint this refuses unless that variable points at the same
        server; otherwise TensorStore would silently talk to real GCS.
        """
        norm = validate_prefix(prefix)
        path = join(self.root, norm) if norm else self.root
        endpoint = self.endpoint_url
        if endpoint is not None and endpoint != GCS_ENDPOINT:
            ts_url = os.environ.get(TENSORSTORE_ENV)
            if ts_url is None or _normalize_endpoint(ts_url, f"${TENSORSTORE_ENV}") != endpoint:
                raise ConfigError(
                    f"{self.url} uses endpoint {redact_url(endpoint)} but TensorStore "
                    f"reads its GCS endpoint from ${TENSORSTORE_ENV}; set it to the same URL"
                )
        return {"driver": "gcs", "bucket": self.bucket, "path": f"{path}/" if path else ""}

    # ---- the client --------------------------------------------------------------------

    async def _filesystem(self) -> Any:
        """The gcsfs filesystem of this loop, built in a thread (credential look-ups block)."""
        loop = asyncio.get_running_loop()
        if self._fs is not None and self._loop is loop:
            return self._fs
        if self._fs_lock is None or self._loop is not loop:
            self._fs_lock, self._fs, self._loop = asyncio.Lock(), None, loop
        async with self._fs_lock:
            if self._fs is None:
                self._fs = await asyncio.to_thread(self._make_filesystem)
        return self._fs

    def _make_filesystem(self) -> Any:
        """A gcsfs filesystem with this source's credentials: the ones another backend's
        filesystem made for the same source, if any (`gcscreds`: no new look-up, no new
        token), else its own, kept for the next."""
        from gcsfs.core import GCSFileSystem  # the core class, whatever gcsfs's env flags say

        key = None
        if self.emulated or self.credentials == "anonymous":
            token: Any = "anon"
        else:
            with contextlib.suppress(OSError):  # an unreadable key file: gcsfs says so
                key = gcscreds.source_key(self.credentials)
            shared = gcscreds.kept(key) if key is not None else None
            source = "google_default" if self.credentials == "default" else self.credentials
            token = shared if shared is not None else source
        try:
            fs = GCSFileSystem(
                project=self.project or "",
                token=token,
                asynchronous=True,
                skip_instance_cache=True,
                endpoint_url=self._location,
            )
        except Exception as exc:
            # Name the source, not the exception text (it may quote a credential file).
            raise CredentialsError(
                f"cannot load GCS credentials from source {self.credentials!r} "
                f"({type(exc).__name__}; {self._credentials_hint()})",
                backend=self.url,
            ) from None
        if key is not None:
            gcscreds.keep(key, fs.credentials.credentials)
        return fs

    async def _request(
        self,
        op: str,
        key: str | None,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
        ok_statuses: tuple[int, ...] = (),
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One HTTP request through gcsfs's session; statuses >= 400 become typed errors."""
        async with self._response(
            op, key, method, url, params=params, headers=headers, data=data, ok=ok_statuses
        ) as resp:
            return resp.status, resp.headers, await resp.read()

    @contextlib.asynccontextmanager
    async def _response(
        self,
        op: str,
        key: str | None,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
        ok: tuple[int, ...] = (),
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """`_request` with the body still to read; failures reading it become typed errors too."""
        fs = await self._filesystem()
        try:
            if fs.credentials.credentials is not None:
                # A token refresh is blocking HTTP inside google-auth: keep it off the loop.
                await asyncio.to_thread(fs.credentials.maybe_refresh)
            session = await fs._set_session()
            all_headers = fs._get_headers(dict(headers or {}))  # adds the auth header
            async with session.request(
                method,
                url,
                params=params,
                headers=all_headers,
                data=data,
                timeout=self._timeout,
                allow_redirects=False,
            ) as resp:
                if resp.status >= 400 and resp.status not in ok:
                    detail = _message(await resp.read())
                    raise error_for(
                        op=op, backend=self.url, key=key, status=resp.status, detail=detail
                    )
                yield resp
        except _TRANSIENT as exc:
            raise transport_error(exc, op=op, backend=self.url, key=key) from exc
        except HttpError as exc:  # gcsfs's wrapping of a failed token refresh
            raise error_for(op=op, backend=self.url, key=key, status=exc.code) from exc
        except (google.auth.exceptions.GoogleAuthError, NonRetryableError) as exc:
            raise CredentialsError(
                f"{op} failed: GCS credentials unusable ({type(exc).__name__}; "
                f"{self._credentials_hint()})",
                backend=self.url,
                key=key,
            ) from exc

    def _credentials_hint(self) -> str:
        """What to set for this backend's credential source (never a credential)."""
        if self.credentials == "default":
            return (
                "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run "
                "`gcloud auth application-default login`, or run where the metadata server "
                "gives credentials; credentials = 'anonymous' for a public bucket"
            )
        return "check that the key file is a valid service-account or authorized-user JSON key"

    def _object_url(self, key: str) -> str:
        name = quote(join(self.root, key), safe="")
        return f"{self._location}/storage/v1/b/{quote(self.bucket, safe='')}/o/{name}"

    def _dir(self, prefix: str) -> str:
        return dir_prefix(self.root, prefix)

    # ---- operations --------------------------------------------------------------------

    async def _check_root(self) -> None:
        url = f"{self._location}/storage/v1/b/{quote(self.bucket, safe='')}"
        try:
            await self._request("check_root", None, "GET", url)
        except NotFoundError:
            where = f" at {redact_url(self._location)}" if self.endpoint_url else ""
            raise NotFoundError(
                f"bucket {self.bucket!r} does not exist{where}", backend=self.url
            ) from None

    @contextlib.asynccontextmanager
    async def _open_range(
        self, key: str, start: int, end: int, generation: str | None
    ) -> AsyncIterator[RangeReply | None]:
        """A media GET of bytes ``[start, end)``, ``ifGenerationMatch`` when given.

        fake-gcs-server ignores the precondition; `read_ranged` also compares every
        reply's ``x-goog-generation``, which it does send.
        """
        params = {"alt": "media"}
        if generation is not None:
            params["ifGenerationMatch"] = generation
        headers = {"Range": f"bytes={start}-{end - 1}"}
        url = self._object_url(key)
        async with self._response(
            "read", key, "GET", url, params=params, headers=headers, ok=(412, 416)
        ) as resp:
            if resp.status == 416:  # the range starts at or past the end: clamp to empty
                yield None
                return
            if resp.status == 412:
                raise replaced(backend=self.url, key=key)
            length = int(resp.headers.get("Content-Length", "-1"))
            first, total = parse_content_range(resp.headers.get("Content-Range"), length)
            version = resp.headers.get("x-goog-generation", "")

            async def chunk() -> bytes:
                try:
                    return await resp.content.readany()
                except _TRANSIENT as exc:
                    raise transport_error(exc, op="read", backend=self.url, key=key) from exc

            yield RangeReply(first, length, total, version, chunk)

    async def _write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await self._upload("write", key, data, precondition=False)

    async def _create(self, key: str, data: bytes | bytearray | memoryview) -> None:
        if self.emulated and await self._exists(key):
            # Documented fallback: emulators ignore ifGenerationMatch.
            raise already_exists(backend=self.url, key=key)
        await self._upload("create", key, data, precondition=True)

    async def _upload(
        self, op: str, key: str, data: bytes | bytearray | memoryview, *, precondition: bool
    ) -> None:
        """Upload in one request, or as a resumable upload from ``resumable_threshold`` bytes.

        With ``precondition`` the upload carries ``ifGenerationMatch=0`` and the
        server's 412 becomes `AlreadyExistsError`.
        """
        view = as_bytes_view(data)
        params = {"name": join(self.root, key)}
        if precondition:
            params["ifGenerationMatch"] = "0"
        upload_url = f"{self._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        octets = "application/octet-stream"
        if view.nbytes < self.resumable_threshold:
            params["uploadType"] = "media"
            status, _, _ = await self._request(
                op,
                key,
                "POST",
                upload_url,
                params=params,
                headers={"Content-Type": octets},
                data=view,
                ok_statuses=(412,),
            )
            self._check_precondition(status, key)
            return
        params["uploadType"] = "resumable"
        status, headers, _ = await self._request(
            op,
            key,
            "POST",
            upload_url,
            params=params,
            headers={"X-Upload-Content-Type": octets},
            ok_statuses=(412,),
        )
        self._check_precondition(status, key)
        session_url = headers["Location"]
        try:
            await self._send_chunks(op, key, session_url, view)
        except BaseException:
            with contextlib.suppress(Exception):  # cancel the session; the failure matters
                await self._request(op, key, "DELETE", session_url, ok_statuses=(499,))
            raise

    def _check_precondition(self, status: int, key: str) -> None:
        if status == 412:
            raise already_exists(backend=self.url, key=key)

    async def _send_chunks(self, op: str, key: str, session_url: str, view: memoryview) -> None:
        """PUT ``view`` to a resumable session, resuming from what the server says it kept."""
        size, offset = view.nbytes, 0
        while True:
            chunk = view[offset : offset + self.chunk_size]
            last = offset + len(chunk) - 1
            content_range = f"bytes {offset}-{last}/{size}" if len(chunk) else f"bytes */{size}"
            status, headers, _ = await self._request(
                op,
                key,
                "PUT",
                session_url,
                headers={"Content-Range": content_range},
                data=chunk,
                ok_statuses=(308, 412),
            )
            self._check_precondition(status, key)
            if status != 308:
                return  # 200/201: the object is complete
            kept = headers.get("Range")  # "bytes=0-N": what the server persisted so far
            offset = int(kept.rsplit("-", 1)[1]) + 1 if kept else 0

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        start = len(self._dir(""))
        infos: list[ObjectInfo] = []
        async for page in self._pages("list", self._dir(prefix)):
            for item in page.get("items", ()):
                name = item["name"][start:]
                if name and not name.endswith("/"):  # skip "directory marker" objects
                    infos.append(ObjectInfo(name, int(item["size"]), _mtime(item)))
        infos.sort(key=lambda info: info.key)
        return infos

    async def _list_dir(self, prefix: str) -> list[str]:
        listed = self._dir(prefix)
        names: set[str] = set()
        async for page in self._pages("list_dir", listed, delimiter="/"):
            names.update(p[len(listed) :].rstrip("/") for p in page.get("prefixes", ()))
            names.update(item["name"][len(listed) :] for item in page.get("items", ()))
        names.discard("")
        return sorted(names)

    async def _pages(self, op: str, gcs_prefix: str, **extra: str) -> Any:
        """Every page of ``objects.list`` below ``gcs_prefix`` (at most 1000 objects each)."""
        url = f"{self._location}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        token: str | None = None
        while True:
            params = {"prefix": gcs_prefix, "maxResults": "1000", **extra}
            if token:
                params["pageToken"] = token
            _, _, body = await self._request(op, gcs_prefix or None, "GET", url, params=params)
            page = json.loads(body)
            yield page
            token = page.get("nextPageToken")
            if not token:
                return

    async def _stat(self, key: str) -> ObjectInfo:
        _, _, body = await self._request("stat", key, "GET", self._object_url(key))
        meta = json.loads(body)
        return ObjectInfo(key, int(meta["size"]), _mtime(meta))

    async def _delete(self, key: str) -> None:
        await self._request("delete", key, "DELETE", self._object_url(key), ok_statuses=(404,))

    async def _delete_prefix(self, prefix: str) -> int:
        infos = await self._list(prefix)
        limit = asyncio.Semaphore(self.concurrency)

        async def delete_one(key: str) -> bool:
            async with limit:
                status, _, _ = await self._request(
                    "delete_prefix", key, "DELETE", self._object_url(key), ok_statuses=(404,)
                )
                return status != 404

        done = await gather_first_error(delete_one(info.key) for info in infos)
        return sum(done)

    async def close(self) -> None:
        """Close the aiohttp session (if it was opened on the running loop)."""
        fs, self._fs = self._fs, None
        session = getattr(fs, "_session", None) if fs is not None else None
        if session is None or session.closed:
            return
        try:
            same_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            await session.close()


def _message(body: bytes) -> str:
    """The ``error.message`` of a GCS JSON error body (or a short text excerpt)."""
    text = body.decode("utf-8", errors="replace")
    try:
        error = json.loads(text).get("error", {})
        return str(error.get("message", "") if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        return text[:200]


def _mtime(meta: Mapping[str, Any]) -> float | None:
    updated = meta.get("updated")
    return datetime.fromisoformat(updated).timestamp() if updated else None
