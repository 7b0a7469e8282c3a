"""S3 (and S3-compatible) backend on s3fs / aiobotocore.

s3fs supplies the session and client set-up (credentials, endpoint, anonymous
signing); the operations call the aiobotocore client directly so that errors
arrive as botocore's `ClientError` with their service code, and so that no
hidden retry loop (s3fs's or botocore's) runs under ours: `RetryPolicy` alone
decides. Large objects go up as multipart uploads with bounded concurrency.

``create`` is ``PutObject`` with ``If-None-Match: *`` (or the same header on
``CompleteMultipartUpload`` for large objects): the server, not the client,
decides who wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import tensorstore as ts
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from ckptstore.backends._errors import (
    already_exists,
    error_for,
    redact_url,
    transport_error,
    transport_errors,
)
from ckptstore.backends.awssession import session_for
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
from ckptstore.backends.sdklog import quiet_aws_sdk, redact_sdk_logs
from ckptstore.errors import (
    ConfigError,
    CredentialsError,
    NotFoundError,
    StorageError,
)
from ckptstore.runtime.futures import gather_first_error

redact_sdk_logs()  # before any client exists: botocore's DEBUG lines quote credentials

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
#: botocore needs each part as bytes (a copy): this bounds the copies alive at once.
PART_BYTES_IN_FLIGHT = 256 * MiB
READ_PART_SIZE = 32 * MiB  # ranged GETs of large reads (docs/benchmarks.md)
READ_CONCURRENCY = 8
TS_REQUEST_CONCURRENCY: int | None = None  # TensorStore's s3_request_concurrency

CREDENTIAL_SOURCES = ("default", "env", "anonymous", "profile")

_TS_CREDENTIALS = {
    "default": {"type": "default"},
    "env": {"type": "environment"},
    "anonymous": {"type": "anonymous"},
}
_TRANSIENT_BOTO = (BotoConnectionError, HTTPClientError, IncompleteReadError)
_TRANSPORT = transport_errors()  # the HTTP stack's "the request may not have happened"
#: Of those, the ones where no server answered at all (a wrong endpoint, a server not up).
_NO_CONNECTION = (BotoConnectionError, ConnectionRefusedError)


def _no_expect_continue(params: dict[str, Any], **_: Any) -> None:
    """Drop the ``Expect: 100-continue`` botocore puts on every PUT and POST with a body.

    aiohttp (under aiobotocore) then sends no body until a ``100 (Continue)`` arrives,
    with no timer: an HTTP/1.0 intermediary, which cannot send one (RFC 9110 10.1.1; a
    Python ``http.server`` proxy, say), holds every upload until the deadline ends it.
    The header only saves sending a body a server would refuse; ours are small or parts.
    """
    params.get("headers", {}).pop("Expect", None)


def _endpoint(option: str | None) -> str | None:
    """The endpoint: the option, else ``$AWS_ENDPOINT_URL_S3``, else ``$AWS_ENDPOINT_URL``
    (the first one set, non-empty), checked by `check_endpoint` under its own name."""
    for field, value in (
        ("S3 option 'endpoint'", option),
        ("$AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
        ("$AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL")),
    ):
        if value:
            return check_endpoint(value, field)
    return None


def as_body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
    """A request body botocore accepts (bytes or bytearray; a memoryview is copied)."""
    if isinstance(data, bytes | bytearray):
        return data
    return bytes(as_bytes_view(data))


class S3Backend(ObjectStoreBackend):
    """Objects under ``s3://bucket/prefix``.

    ``credentials`` names where credentials come from, never the secret:
    ``"default"`` (the AWS default chain), ``"env"`` (only ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``), ``"anonymous"`` (unsigned)
    or ``"profile"`` (the shared-config profile ``profile``). Objects of at least
    ``multipart_threshold`` bytes are uploaded in ``part_size`` parts, at most
    ``concurrency`` parts in flight across the backend. Reads of more than
    ``read_part_size`` bytes are ranged GETs of that size, at most
    ``read_concurrency`` beyond each read's first in flight (see `objectstore`).
    ``connect_timeout`` and ``read_timeout`` (seconds) end a stalled request.
    """

    kind = "s3"
    ts_concurrency_resource = "s3_request_concurrency"
    ts_retries_resource = "s3_request_retries"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        credentials: str = "default",
        profile: str | None = None,
        concurrency: int = 32,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen, immutable
        multipart_threshold: int = 100 * MiB,  # AWS: consider multipart from ~100 MB
        part_size: int = 32 * MiB,
        read_part_size: int = READ_PART_SIZE,
        read_concurrency: int = READ_CONCURRENCY,
        ts_request_concurrency: int | None = TS_REQUEST_CONCURRENCY,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
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
            raise ConfigError(f"invalid S3 bucket name {bucket!r}")
        _refuse_moto_in_process_mock()
        if credentials not in CREDENTIAL_SOURCES:
            raise ConfigError(
                f"S3 credentials must be one of {', '.join(CREDENTIAL_SOURCES)}; got "
                "something else, not shown in case it is a secret (pass the source, never "
                "the secret)"
            )
        if (credentials == "profile") != (profile is not None):
            raise ConfigError("S3 profile= is given exactly when credentials='profile'")
        if part_size < MIN_PART_SIZE:
            raise ConfigError(f"S3 part_size must be >= {MIN_PART_SIZE} (5 MiB), got {part_size}")
        if multipart_threshold < MIN_PART_SIZE:
            raise ConfigError(f"S3 multipart_threshold must be >= {MIN_PART_SIZE} (5 MiB)")
        self.bucket = bucket
        self.root = validate_prefix(prefix)
        # AWS convention: the service-specific variable, then the general one. Resolved here
        # once, so s3fs and TensorStore (which reads neither) reach the same server.
        # Checked here, so no SDK sees a malformed one or one carrying credentials.
        self.endpoint_url = _endpoint(endpoint_url)
        self.region = region
        self.credentials = credentials
        self.profile = profile
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.capabilities = Capabilities(
            atomic_rename=False, conditional_create=True, server_side_copy=True, durable_writes=True
        )
        self._fs: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._parts: asyncio.Semaphore | None = None
        self._ts_root: Any = None  # the bucket held open in ts_context (see _new_ts_context)

    # ---- identity ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.root}" if self.root else f"s3://{self.bucket}"

    @property
    def location(self) -> str:
        return f"{self.endpoint_url or 'default'}|{self.url}"

    def __repr__(self) -> str:
        where = f" endpoint={redact_url(self.endpoint_url)}" if self.endpoint_url else ""
        return f"<S3Backend {self.url}{where} credentials={self.credentials}>"

    def kvstore_spec(self, prefix: str = "") -> dict[str, Any]:
        norm = validate_prefix(prefix)
        path = join(self.root, norm) if norm else self.root
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": self.bucket,
            "path": f"{path}/" if path else "",
        }
        if self.endpoint_url:
            spec["endpoint"] = self.endpoint_url
        region = self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region is None and self.endpoint_url:
            region = "us-east-1"  # S3-compatible servers ignore it; TensorStore must not probe
        if region:
            spec["aws_region"] = region
        spec["aws_credentials"] = self._ts_credentials()
        return spec

    def _ts_credentials(self) -> dict[str, Any]:
        """TensorStore's ``aws_credentials`` for this backend's credential source."""
        if self.credentials == "profile":
            return {"type": "profile", "profile": self.profile}
        return dict(_TS_CREDENTIALS[self.credentials])

    def _new_ts_context(self) -> ts.Context:
        """The context, with its AWS credential provider built now, while the AWS SDK's
        error lines about sources it skipped are held back (see `sdklog`).

        TensorStore builds one provider per open bucket in a context, on the first open
        (synchronously, in the calling thread), and reuses it for every path below while
        that bucket stays open, so the bucket's root stays open with the backend. Opening
        it sends no request when the region is known (else TensorStore asks the bucket for
        it, as the first real open would).
        """
        ctx = super()._new_ts_context()
        with quiet_aws_sdk():
            self._ts_root = ts.KvStore.open(self.kvstore_spec(), context=ctx)
        return ctx

    # ---- the client --------------------------------------------------------------------

    def _filesystem(self) -> Any:
        """The s3fs filesystem of the running loop (a new one if the loop changed)."""
        loop = asyncio.get_running_loop()
        if self._fs is None or self._loop is not loop:
            import s3fs

            kwargs: dict[str, Any] = {}
            if self.credentials == "anonymous":
                kwargs["anon"] = True
            else:
                kwargs["session"] = session_for(self.credentials, self.profile)
            fs = s3fs.S3FileSystem(
                asynchronous=True,
                skip_instance_cache=True,
                endpoint_url=self.endpoint_url,
                client_kwargs={"region_name": self.region} if self.region else {},
                config_kwargs={
                    # One attempt per call: our RetryPolicy is the only retry loop.
                    "retries": {"total_max_attempts": 1, "mode": "standard"},
                    "max_pool_connections": 2 * self.concurrency,
                    "connect_timeout": self.connect_timeout,
                    "read_timeout": self.read_timeout,
                },
                **kwargs,
            )
            fs.retries = 1
            parts_in_flight = min(self.concurrency, max(1, PART_BYTES_IN_FLIGHT // self.part_size))
            self._fs, self._loop, self._parts = fs, loop, asyncio.Semaphore(parts_in_flight)
        return self._fs

    async def _check_root(self) -> None:
        try:
            await self._call("check_root", None, "head_bucket")
        except NotFoundError:
            where = f" at {redact_url(self.endpoint_url)}" if self.endpoint_url else ""
            raise NotFoundError(
                f"bucket {self.bucket!r} does not exist{where}", backend=self.url
            ) from None

    async def _call(self, op: str, key: str | None, method: str, **kwargs: Any) -> Any:
        """Call one S3 API method on this bucket, mapping every failure to a typed error."""
        try:
            client = await self._filesystem().set_session()
            client.meta.events.register_last(
                "before-call.s3", _no_expect_continue, unique_id="ckptstore-no-expect"
            )
            return await getattr(client, method)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            raise self._client_error(exc, op, key) from exc
        except Exception as exc:
            raise self._other_error(exc, op, key) from exc

    def _client_error(self, exc: ClientError, op: str, key: str | None) -> StorageError:
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error_for(
            op=op,
            backend=self.url,
            key=key,
            status=status,
            code=error.get("Code"),
            detail=error.get("Message", ""),
        )

    def _other_error(self, exc: Exception, op: str, key: str | None) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, _TRANSIENT_BOTO + _TRANSPORT):
            hint = self._endpoint_hint() if isinstance(exc, _NO_CONNECTION) else ""
            return transport_error(exc, op=op, backend=self.url, key=key, hint=hint)
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            hint = {
                "env": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                "profile": f"check profile {self.profile!r}",
            }.get(
                self.credentials,
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or the shared "
                "credentials file; credentials = 'anonymous' for a public bucket",
            )
            return CredentialsError(
                f"{op} failed: no usable AWS credentials from source {self.credentials!r} ({hint})",
                backend=self.url,
                key=key,
            )
        if isinstance(exc, ProfileNotFound):
            raise ConfigError(f"AWS profile {self.profile!r} not found ({self.url})") from None
        if isinstance(exc, BotoCoreError):
            return StorageError(f"{op} failed: {type(exc).__name__}", backend=self.url, key=key)
        raise exc

    def _endpoint_hint(self) -> str:
        """What to check when nothing answered: the endpoint and where it may be set."""
        where = redact_url(self.endpoint_url) if self.endpoint_url else "AWS's own endpoint"
        return (
            f"nothing answered at {where}: check the endpoint (--endpoint, the profile's "
            "endpoint option, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)"
        )

    def _full(self, key: str) -> str:
        return join(self.root, key)

    def _dir(self, prefix: str) -> str:
        """The S3 key prefix of a directory-like ``prefix`` ("" for the bucket root)."""
        return dir_prefix(self.root, prefix)

    # ---- operations --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _open_range(
        self, key: str, start: int, end: int, version: str | None
    ) -> AsyncIterator[RangeReply | None]:
        """``GetObject`` of bytes ``[start, end)``, ``If-Match: version`` when given."""
        extra = {"IfMatch": version} if version is not None else {}
        try:
            resp = await self._call(
                "read",
                key,
                "get_object",
                Key=self._full(key),
                Range=f"bytes={start}-{end - 1}",
                **extra,
            )
        except StorageError as exc:
            if _error_code(exc) == "InvalidRange":
                resp = None  # the range starts at or past the end: clamp to empty
            elif version is not None and _precondition_failed(exc):
                raise replaced(backend=self.url, key=key) from exc
            else:
                raise
        if resp is None:
            yield None
            return
        body = resp["Body"]
        content = body.raw_stream.content  # aiohttp's stream: its chunks as received

        async def chunk() -> bytes:
            try:
                data: bytes = await content.readany()
            except Exception as exc:
                raise self._other_error(exc, "read", key) from exc
            return data

        async with body:
            length = int(resp["ContentLength"])
            first, total = parse_content_range(resp.get("ContentRange"), length)
            yield RangeReply(first, length, total, str(resp.get("ETag", "")), chunk)

    async def _write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        view = as_bytes_view(data)
        if view.nbytes >= self.multipart_threshold:
            await self._multipart("write", key, view, create=False)
        else:
            await self._call("write", key, "put_object", Key=self._full(key), Body=as_body(data))

    async def _create(self, key: str, data: bytes | bytearray | memoryview) -> None:
        view = as_bytes_view(data)
        try:
            if view.nbytes >= self.multipart_threshold:
                if await self._exists(key):  # cheap early exit before a big upload
                    raise already_exists(backend=self.url, key=key)
                await self._multipart("create", key, view, create=True)
            else:
                await self._call(
                    "create",
                    key,
                    "put_object",
                    Key=self._full(key),
                    Body=as_body(data),
                    IfNoneMatch="*",
                )
        except StorageError as exc:
            if _precondition_failed(exc):
                raise already_exists(backend=self.url, key=key) from exc
            raise

    async def _multipart(self, op: str, key: str, view: memoryview, *, create: bool) -> None:
        """Upload ``view`` in parts, at most ``concurrency`` (and 256 MiB) in flight.

        A failure aborts the upload.
        """
        full = self._full(key)
        size = view.nbytes
        part_size = max(self.part_size, math.ceil(size / MAX_PARTS))
        count = math.ceil(size / part_size)
        upload = await self._call(op, key, "create_multipart_upload", Key=full)
        upload_id = upload["UploadId"]
        parts_sem = self._parts  # set with the filesystem of this loop
        assert parts_sem is not None

        async def put_part(index: int) -> dict[str, Any]:
            async with parts_sem:
                body = bytes(view[index * part_size : (index + 1) * part_size])
                resp = await self._call(
                    op,
                    key,
                    "upload_part",
                    Key=full,
                    UploadId=upload_id,
                    PartNumber=index + 1,
                    Body=body,
                )
                return {"PartNumber": index + 1, "ETag": resp["ETag"]}

        try:
            parts = await gather_first_error([put_part(i) for i in range(count)])
            await self._call(
                op,
                key,
                "complete_multipart_upload",
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **({"IfNoneMatch": "*"} if create else {}),
            )
        except BaseException:
            # Best effort: the original failure matters, not the cleanup's.
            with contextlib.suppress(Exception):
                await self._call(op, key, "abort_multipart_upload", Key=full, UploadId=upload_id)
            raise

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        start = len(self._dir(""))  # strip the backend root from every S3 key
        infos: list[ObjectInfo] = []
        async for page in self._pages("list", self._dir(prefix)):
            for obj in page.get("Contents", ()):
                name = obj["Key"][start:]
                if name and not name.endswith("/"):  # skip "directory marker" objects
                    mtime = obj.get("LastModified")
                    infos.append(ObjectInfo(name, obj["Size"], mtime and mtime.timestamp()))
        infos.sort(key=lambda info: info.key)
        return infos

    async def _list_dir(self, prefix: str) -> list[str]:
        listed = self._dir(prefix)
        names: set[str] = set()
        async for page in self._pages("list_dir", listed, Delimiter="/"):
            for common in page.get("CommonPrefixes", ()):
                names.add(common["Prefix"][len(listed) :].rstrip("/"))
            for obj in page.get("Contents", ()):
                names.add(obj["Key"][len(listed) :])
        names.discard("")
        return sorted(names)

    async def _pages(self, op: str, s3_prefix: str, **extra: Any) -> Any:
        """Every ``ListObjectsV2`` page below ``s3_prefix`` (S3 returns at most 1000 keys each)."""
        token: str | None = None
        while True:
            kwargs = dict(extra, Prefix=s3_prefix)
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._call(op, s3_prefix or None, "list_objects_v2", **kwargs)
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    async def _stat(self, key: str) -> ObjectInfo:
        head = await self._call("stat", key, "head_object", Key=self._full(key))
        mtime = head.get("LastModified")
        return ObjectInfo(key, head["ContentLength"], mtime and mtime.timestamp())

    async def _delete(self, key: str) -> None:
        await self._call("delete", key, "delete_object", Key=self._full(key))

    async def _delete_prefix(self, prefix: str) -> int:
        keys = [self._full(info.key) for info in await self._list(prefix)]
        deleted = 0
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            resp = await self._call(
                "delete_prefix",
                prefix,
                "delete_objects",
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise error_for(
                    op="delete_prefix",
                    backend=self.url,
                    key=first.get("Key", prefix),
                    status=None,
                    code=first.get("Code"),
                    detail=f"{len(errors)} of {len(batch)} deletes failed: {first.get('Message')}",
                )
            deleted += len(batch)
        return deleted

    async def close(self) -> None:
        """Close the aiobotocore client (if it was opened on the running loop)."""
        fs, self._fs = self._fs, None
        if fs is None or fs._s3 is None:
            return
        try:
            same_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            await fs._s3creator.__aexit__(None, None, None)
        fs._s3 = None


def _error_code(exc: StorageError) -> str | None:
    """S3's error code behind ``exc`` (None if it did not come from an S3 error reply)."""
    cause = exc.__cause__
    if not isinstance(cause, ClientError):
        return None
    code: str | None = cause.response.get("Error", {}).get("Code")
    return code


def _precondition_failed(exc: StorageError) -> bool:
    """Whether ``exc`` is S3's answer to a failed ``If-None-Match``/``If-Match`` (412)."""
    cause = exc.__cause__
    if not isinstance(cause, ClientError):
        return False
    status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return bool(_error_code(exc) == "PreconditionFailed" or status == 412)


def _refuse_moto_in_process_mock() -> None:
    """`ConfigError` while moto's in-process ``mock_aws()`` is active: it intercepts
    botocore's requests with synchronous replies that aiobotocore (s3fs) cannot await (a
    ``TypeError`` deep inside it), and TensorStore's own S3 client, which writes the
    array data, never sees the mock at all. moto's server mode works: the pytest plugin's
    ``ckptstore_s3_bucket`` fixture, or ``moto.server.ThreadedMotoServer`` with
    ``endpoint_url`` (docs/testing.md)."""
    models = sys.modules.get("moto.core.models")  # only if the test imported moto
    mock = getattr(models, "MockAWS", None)
    if getattr(mock, "_nested_count", 0):
        raise ConfigError(
            "moto's in-process mock_aws() is active: ckptstore's S3 clients (aiobotocore, "
            "and TensorStore's own) cannot run against it; use moto's server mode instead: "
            "the ckptstore_s3_bucket pytest fixture (pip install 'ckptstore[testing]'), or "
            "moto.server.ThreadedMotoServer with endpoint_url= (see docs/testing.md)"
        )
