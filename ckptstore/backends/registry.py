"""Opening backends from URLs and per-environment TOML profiles.

URLs: ``/abs/path``, ``relative/path``, ``file:///abs/path``, ``memory://NAME``,
``s3://bucket/prefix``, ``gs://bucket/prefix`` (also ``gcs://``), and the schemes other
packages register (`ckptstore.backends.schemes`).

A profile is a small TOML file naming a backend and its options::

    url = "s3://my-bucket/checkpoints"

    [options]
    region = "us-west-2"
    credentials = "default"      # where credentials come from; never the secret itself
    concurrency = 64

    [options.retry]
    max_attempts = 8

String values may use ``${VAR}`` or ``${VAR:-default}`` to read the environment. A relative
path (``url = "ckpt"``, a ``[tiers]`` entry) is relative to the profile file's folder, not to
the working directory. A local backend's ``create = false`` refuses to create a missing root
(an unmounted volume must not quietly fill the disk below its mount point).

Where a profile is asked for (``open_backend(profile=...)``, ``$CKPTSTORE_PROFILE``, the
command line's ``--profile``), give a path or a bare name: ``moto`` is read from
``$CKPTSTORE_PROFILES_DIR/moto.toml`` (default ``~/.config/ckptstore/profiles``). With no
target at all, the entry points use the profile in ``$CKPTSTORE_PROFILE``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ckptstore.backends import schemes
from ckptstore.backends._errors import redact_text, redact_url
from ckptstore.backends.base import Backend
from ckptstore.backends.endpoints import check_endpoint
from ckptstore.backends.retry import RetryPolicy
from ckptstore.errors import ConfigError, InvalidURLError

PROFILE_ENV = "CKPTSTORE_PROFILE"
PROFILES_DIR_ENV = "CKPTSTORE_PROFILES_DIR"

#: Option types checked before a backend sees them (the rest check themselves).
_OPTION_TYPES: dict[str, type] = {
    **dict.fromkeys(("endpoint", "region", "credentials", "profile", "project"), str),
    **dict.fromkeys(("fsync", "drop_cache", "create"), bool),
    **dict.fromkeys(("multipart_threshold", "part_size", "resumable_threshold", "chunk_size"), int),
    **dict.fromkeys(("read_part_size", "read_concurrency"), int),
}
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def open_backend(
    url: str | os.PathLike[str] | None = None,
    *,
    profile: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Backend:
    """Open the backend a URL or a profile names; explicit ``options`` override the profile's.

    ``profile`` is a path or a name (see `resolve_profile`). With neither ``url`` nor
    ``profile``, the profile named by ``$CKPTSTORE_PROFILE`` is used.
    """
    if url is None and profile is None:
        profile = os.environ.get(PROFILE_ENV) or None
        if profile is None:
            raise InvalidURLError(f"give a backend URL, a profile, or set ${PROFILE_ENV}")
    if profile is not None:
        loaded = load_profile(profile)
        if "tiers" in loaded:
            raise ConfigError(
                f"profile {profile} describes two tiers, not one backend: "
                "open it with ckptstore.Tiered.from_profile"
            )
        if url is None:
            url = loaded["url"]
        options = {**loaded.get("options", {}), **options}
    assert url is not None
    kind, location = parse_url(os.fspath(url))
    return _build(kind, location, options, source=redact(os.fspath(url)))


def parse_url(url: str) -> tuple[str, tuple[str, str]]:
    """Split a backend URL into its kind and ``(bucket-or-root, prefix)``."""
    if not url:
        raise InvalidURLError("empty backend URL")
    if "\x00" in url:
        raise InvalidURLError(f"{redact(url)!r} contains a NUL character")
    if "://" not in url:
        return "local", (os.path.abspath(url), "")
    parts = urlsplit(url)
    shown = redact(url)
    scheme = parts.scheme.lower()
    found = schemes.lookup(scheme)
    if found is None:
        known = ", ".join(f"{s}://" for s in schemes.known())
        raise InvalidURLError(f"unknown scheme {scheme!r} in {shown!r}; use a path or {known}")
    if parts.query or parts.fragment:
        raise InvalidURLError(f"{shown!r}: query strings and fragments are not supported")
    kind = found.kind
    if kind == "local":
        if parts.netloc not in ("", "localhost"):
            raise InvalidURLError(f"{shown!r}: file URLs must be file:///absolute/path")
        return kind, (parts.path or "/", "")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise InvalidURLError(f"{scheme}:// URLs take no credentials or ports; use options")
    if kind == "memory":
        name = parts.netloc + parts.path.rstrip("/")
        if not name:
            raise InvalidURLError(
                f"{shown!r} names no store: use memory://NAME (an unnamed memory store belongs "
                "to one Backend object, so nothing saved through this URL could be read back)"
            )
        return kind, (name, "")
    bucket = parts.netloc
    if not bucket:
        raise InvalidURLError(f"{shown!r} names no bucket")
    return kind, (bucket, parts.path.strip("/"))


def redact(url: str) -> str:
    """``url`` fit for messages: no ``user:password@`` part (everything up to the last
    ``@`` after the scheme goes), and no query string or fragment (a signed URL's
    ``X-Amz-Signature=...&X-Amz-Credential=...``): they are shown as ``?***``."""
    if "://" not in url:
        return url  # a path: nothing in it is a credential ckptstore would send anywhere
    url = redact_url(url)
    cut = re.search(r"[?#]", url)
    if cut is not None:
        url = url[: cut.start()] + "?***"
    return redact_text(url)


def profiles_dir() -> Path:
    """Where profiles given by name live: ``$CKPTSTORE_PROFILES_DIR``, else
    ``$XDG_CONFIG_HOME/ckptstore/profiles`` (``~/.config/ckptstore/profiles``)."""
    configured = os.environ.get(PROFILES_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join("~", ".config")
    return Path(config).expanduser() / "ckptstore" / "profiles"


def resolve_profile(profile: str | os.PathLike[str]) -> Path:
    """The file a profile argument names: a path as given, or a bare name (no ``/``, no
    ``.toml``) looked up as ``NAME.toml`` in `profiles_dir`."""
    text = os.fspath(profile)
    if not text:
        raise ConfigError("empty profile name")
    if os.sep in text or "/" in text or text.endswith(".toml"):
        return Path(text).expanduser()
    file = profiles_dir() / f"{text}.toml"
    if not file.is_file():
        raise ConfigError(
            f"no profile named {text!r}: {file} does not exist (profiles by name live in "
            f"${PROFILES_DIR_ENV}, default ~/.config/ckptstore/profiles)"
        )
    return file


def target_profile(target: str | os.PathLike[str]) -> Path | None:
    """The profile a target names, by the one rule every entry point follows (Python and
    CLI): a path ending in ``.toml`` is a profile file; a bare name (no ``/``, no scheme)
    for which ``NAME.toml`` exists in `profiles_dir` is that profile, and a `ConfigError`
    if ``./NAME`` exists too (say which one: ``./NAME`` or the profile's path); anything
    else (a URL, a path, a bare name with no profile) is storage: None."""
    text = os.fspath(target)
    if text.endswith(".toml"):
        return Path(text).expanduser()
    if not text or "/" in text or os.sep in text or "://" in text or text in (".", ".."):
        return None
    file = profiles_dir() / f"{text}.toml"
    if not file.is_file():
        return None
    if os.path.exists(text):
        raise ConfigError(
            f"{text!r} names both the profile {file} and the path ./{text}: pass ./{text} "
            f"for the directory, or {file} for the profile"
        )
    return file


def env_profile() -> Path | None:
    """The profile file ``$CKPTSTORE_PROFILE`` names (a path or a name, see
    `resolve_profile`), or None when it is unset: what a target of None means."""
    named = os.environ.get(PROFILE_ENV)
    return resolve_profile(named) if named else None


def load_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a profile (a path or a name): ``{"url": str, "options": {...}}``
    with env refs expanded and relative paths made absolute against the profile's folder
    (plus ``"manager": {...}``, the `CheckpointManager`'s table, when the profile has one)."""
    if "://" in str(path):  # Path() would fold "s3://b/x" into "s3:/b/x"
        raise ConfigError(f"{path} is a URL; a profile is a .toml file (or its name)")
    file = resolve_profile(path)
    try:
        raw = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"profile {file} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"profile {file} is a directory, not a .toml file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ConfigError(f"profile {file} is not valid TOML: {why}") from None
    unknown = set(raw) - {"url", "options", "description", "manager", "tiers"}
    if unknown:
        raise ConfigError(f"profile {file}: unknown top-level keys {sorted(unknown)}")
    if "tiers" in raw:  # a tiered target (ckptstore.Tiered.from_profile): no url of its own
        if not isinstance(raw["tiers"], dict) or "url" in raw or "options" in raw:
            raise ConfigError(f"profile {file}: [tiers] is a table and replaces url/[options]")
        tiers = _expand(raw["tiers"], file)
        for tier in ("fast", "durable"):
            if isinstance(tiers.get(tier), str):
                tiers[tier] = _beside(file, tiers[tier])
        return {
            "tiers": tiers,
            **(
                {"manager": _expand(raw["manager"], file)}
                if isinstance(raw.get("manager"), dict)
                else {}
            ),
        }
    if not isinstance(raw.get("url"), str):
        raise ConfigError(f"profile {file}: 'url' (a string) is required")
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"profile {file}: [options] must be a table")
    profile = {"url": _beside(file, _expand(raw["url"], file)), "options": _expand(options, file)}
    if "manager" in raw:  # the checkpoint manager's table, passed through uninterpreted
        if not isinstance(raw["manager"], dict):
            raise ConfigError(f"profile {file}: [manager] must be a table")
        profile["manager"] = _expand(raw["manager"], file)
    kind, _ = parse_url(profile["url"])
    _check_options(kind, profile["options"], source=str(file))
    if "retry" in profile["options"]:
        _retry(profile["options"]["retry"], str(file))  # checked field by field now
    return profile


def _beside(file: Path, target: str) -> str:
    """``target`` (a URL or path in the profile ``file``) with a relative path made absolute
    against the profile's folder; URLs and absolute paths unchanged."""
    if not target or "://" in target or os.path.isabs(os.path.expanduser(target)):
        return os.path.expanduser(target)
    return os.path.join(os.path.dirname(os.path.abspath(file)), target)


def _expand(value: Any, file: Path) -> Any:
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise ConfigError(f"profile {file}: environment variable ${{{name}}} is not set")

        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v, file) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, file) for v in value]
    return value


def _check_options(kind: str, options: Mapping[str, Any], *, source: str) -> None:
    unknown = set(options) - schemes.of_kind(kind).allowed
    if unknown:
        allowed = ", ".join(sorted(schemes.of_kind(kind).allowed))
        raise ConfigError(
            f"{source}: unknown option(s) {sorted(unknown)} for a {kind} backend "
            f"(allowed: {allowed})"
        )
    for name, value in options.items():
        want = _OPTION_TYPES.get(name)
        if want is not None and (type(value) is not want):  # a bool is no int here
            shown = "a value" if name in ("credentials", "endpoint") else repr(value)[:40]
            raise ConfigError(f"{source}: option {name!r} must be a {want.__name__}, not {shown}")
    if options.get("endpoint"):  # before any SDK sees it (see `check_endpoint`)
        check_endpoint(options["endpoint"], f"{source}: option 'endpoint'", bare_host=kind == "gcs")


def _retry(value: Any, source: str) -> RetryPolicy:
    if isinstance(value, RetryPolicy):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return RetryPolicy(max_attempts=value)
    if isinstance(value, Mapping):
        unknown = set(value) - {"max_attempts", "base_delay", "max_delay", "deadline", "min_rate"}
        if unknown:
            raise ConfigError(f"{source}: unknown retry setting(s) {sorted(unknown)}")
        try:
            return RetryPolicy(**value)
        except ConfigError as exc:  # name where it came from: "[options.retry] max_delay"
            raise ConfigError(
                f"{source}: [options.retry] {str(exc).removeprefix('retry ')}"
            ) from None
    raise ConfigError(
        f"{source}: option 'retry' must be a RetryPolicy, an int (max_attempts) or a table, "
        f"not a {type(value).__name__}"
    )


def require_extra(kind: str) -> None:
    """Raise `ConfigError` naming the extra to install if a ``kind`` backend's packages are
    missing (s3fs and gcsfs are optional: ``pip install 'ckptstore[s3]'``)."""
    missing = [m for m in schemes.of_kind(kind).extras if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"{kind} backends need {', '.join(missing)}, which is not installed: "
            f"pip install 'ckptstore[{kind}]'"
        )


def _build(kind: str, location: tuple[str, str], options: dict[str, Any], source: str) -> Backend:
    _check_options(kind, options, source=source)
    require_extra(kind)
    opts = dict(options)
    if "retry" in opts:
        opts["retry"] = _retry(opts["retry"], source)
    if "endpoint" in opts:
        opts["endpoint_url"] = opts.pop("endpoint")
    root, prefix = location
    return schemes.of_kind(kind).build(root, prefix, opts)
