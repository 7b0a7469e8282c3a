"""The URL schemes ckptstore opens, each a `Scheme`: how it builds its backend and which
options it takes.

Built in: ``file://`` (and plain paths), ``memory://``, ``s3://``, ``gs://`` and ``gcs://``.
A third-party backend adds its own with `register_scheme` (fsspec's
``register_implementation`` is the model), or by naming a `Scheme` (or just its build
function) in its package's ``ckptstore.backends`` entry points, looked up the first time a
URL uses the scheme::

    [project.entry-points."ckptstore.backends"]
    azure = "mypkg.azure:SCHEME"

Its URLs read as ``<scheme>://<bucket>/<prefix>``; ``build(bucket, prefix, options)`` gets the
options a profile or ``open_backend(..., **options)`` gave, checked against ``options``
(``concurrency`` and ``retry``, as a `ckptstore.backends.retry.RetryPolicy`, always allowed).
`ckptstore.testing.conformance` is the suite a new backend should pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.errors import ConfigError

ENTRY_POINTS = "ckptstore.backends"

#: What every backend takes.
COMMON = frozenset({"concurrency", "retry"})
_OBJECT = frozenset(
    {"read_part_size", "read_concurrency", "ts_request_concurrency", "connect_timeout"}
    | {"read_timeout"}
)
_NAME = re.compile(r"[a-z][a-z0-9+.-]*")

Build = Callable[[str, str, dict[str, Any]], Backend]


@dataclass(frozen=True)
class Scheme:
    """How URLs of a scheme open a backend.

    ``build(bucket, prefix, options)``: the backend (for ``local``, ``bucket`` is the root
    path; for ``memory``, the store's name). ``options``: what it takes besides `COMMON`.
    ``kind``: its name in messages and the option table, shared by schemes that are one
    backend (``gs`` and ``gcs``); the scheme itself unless given. ``extras``: modules it needs,
    named in `ckptstore.errors.ConfigError` as ``pip install 'ckptstore[<kind>]'`` when
    missing.
    """

    build: Build
    options: frozenset[str] = field(default_factory=frozenset)
    kind: str = ""
    extras: tuple[str, ...] = ()

    @property
    def allowed(self) -> frozenset[str]:
        return COMMON | self.options


def _local(root: str, _prefix: str, opts: dict[str, Any]) -> Backend:
    from ckptstore.backends.local import LocalBackend

    return LocalBackend(root, **opts)


def _memory(name: str, _prefix: str, opts: dict[str, Any]) -> Backend:
    from ckptstore.backends.memory import MemoryBackend

    return MemoryBackend(name or None, **opts)


def _s3(bucket: str, prefix: str, opts: dict[str, Any]) -> Backend:
    from ckptstore.backends.s3 import S3Backend

    return S3Backend(bucket, prefix, **opts)


def _gcs(bucket: str, prefix: str, opts: dict[str, Any]) -> Backend:
    from ckptstore.backends.gcs import GcsBackend

    return GcsBackend(bucket, prefix, **opts)


_GCS = Scheme(
    _gcs,
    _OBJECT
    | {"endpoint", "emulator", "project", "credentials", "resumable_threshold", "chunk_size"},
    "gcs",
    ("gcsfs",),
)
_SCHEMES: dict[str, Scheme] = {
    "file": Scheme(_local, frozenset({"fsync", "drop_cache", "create"}), "local"),
    "memory": Scheme(_memory, frozenset(), "memory"),
    "s3": Scheme(
        _s3,
        _OBJECT
        | {"endpoint", "region", "credentials", "profile", "multipart_threshold", "part_size"},
        "s3",
        ("s3fs",),
    ),
    "gs": _GCS,
    "gcs": _GCS,
}


def register_scheme(scheme: str, backend: Scheme | Build, *, options: Iterable[str] = ()) -> None:
    """Open ``<scheme>://`` URLs with ``backend``: a `Scheme`, or its build function (then
    ``options`` names what it takes). `ConfigError` for a bad name or one already taken;
    registering the same again changes nothing."""
    if not isinstance(scheme, str) or not _NAME.fullmatch(scheme):
        raise ConfigError(f"register_scheme: {scheme!r} is not a URL scheme (lowercase, a-z first)")
    if not isinstance(backend, Scheme):
        if not callable(backend):
            raise ConfigError(f"register_scheme({scheme!r}): expected a Scheme or a callable")
        backend = Scheme(backend, frozenset(options))
    if not backend.kind:
        backend = Scheme(backend.build, backend.options, scheme, backend.extras)
    held = _SCHEMES.get(scheme, backend)
    if held != backend:
        raise ConfigError(f"URL scheme {scheme!r} is already registered ({held.kind})")
    if any(s.kind == backend.kind and s != backend for s in _SCHEMES.values()):
        raise ConfigError(f"register_scheme({scheme!r}): the kind {backend.kind!r} is taken")
    _SCHEMES[scheme] = backend


def lookup(scheme: str) -> Scheme | None:
    """The `Scheme` of ``scheme`` (registered, built in, or an entry point's); None if none."""
    if scheme not in _SCHEMES:
        for point in entry_points(group=ENTRY_POINTS, name=scheme):
            register_scheme(scheme, point.load())
    return _SCHEMES.get(scheme)


def of_kind(kind: str) -> Scheme:
    """The `Scheme` a backend kind names (``local``, ``s3``, or a registered scheme's)."""
    return next(s for s in _SCHEMES.values() if s.kind == kind)


def known() -> list[str]:
    """The schemes known so far."""
    return list(_SCHEMES)
