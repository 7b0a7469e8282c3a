"""URL schemes are registered: a third-party backend's scheme, registered or named in a
package's ``ckptstore.backends`` entry points, opens through every entry point that takes a
URL (a save, a restore, a profile), with its options checked; bad registrations are typed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.base import Backend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.backends.registry import load_profile, open_backend, parse_url
from ckptstore.backends.schemes import Scheme, known, register_scheme
from ckptstore.errors import ConfigError, InvalidURLError
from tests.distributions import installed

BUILT: list[tuple[str, str, dict[str, Any]]] = []


def build(bucket: str, prefix: str, options: dict[str, Any]) -> Backend:
    """A backend of its own kind: a named memory store per bucket and prefix."""
    BUILT.append((bucket, prefix, dict(options)))
    options.pop("label", None)
    return MemoryBackend(f"tmem-{bucket}-{prefix}", **options)


register_scheme("tmem", build, options=["label"])


def test_a_registered_scheme_saves_and_restores_through_its_urls() -> None:
    state = {"w": np.arange(12.0).reshape(3, 4)}
    asyncio.run(ckptstore.save("tmem://bucket/run", state, step=1))
    got = asyncio.run(ckptstore.restore("tmem://bucket/run"))
    assert got["w"].tobytes() == state["w"].tobytes()
    assert parse_url("tmem://bucket/a/b/") == ("tmem", ("bucket", "a/b"))
    assert BUILT[-1][:2] == ("bucket", "run") and "tmem" in known()


def test_its_options_are_checked_and_passed(tmp_path: Path) -> None:
    backend = open_backend("tmem://b/p", label="x", concurrency=4)
    assert isinstance(backend, MemoryBackend) and BUILT[-1][2] == {"label": "x", "concurrency": 4}
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['fsync'\] for a tmem backend"):
        open_backend("tmem://b/p", fsync=True)
    profile = tmp_path / "p.toml"
    profile.write_text('url = "tmem://b/q"\n[options]\nregion = "x"\n')
    with pytest.raises(ConfigError, match="allowed: concurrency, label, retry"):
        load_profile(profile)


def test_bad_registrations_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="is not a URL scheme"):
        register_scheme("Bad Name", build)
    with pytest.raises(ConfigError, match="expected a Scheme or a callable"):
        register_scheme("tnone", 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"'s3' is already registered \(s3\)"):
        register_scheme("s3", build)
    with pytest.raises(ConfigError, match="the kind 'local' is taken"):
        register_scheme("tlocal", Scheme(build, kind="local"))
    register_scheme("tmem", build, options=["label"])  # the same again: nothing changes
    with pytest.raises(InvalidURLError, match=r"unknown scheme 'nosuch'.*tmem://"):
        parse_url("nosuch://b/p")


def test_a_package_entry_point_names_a_scheme(tmp_path: Path) -> None:
    """A distribution on the path (its dist-info as pip writes it) whose
    ``ckptstore.backends`` entry point names a `Scheme`: found the first time a URL uses it."""
    source = (
        "from ckptstore.backends.schemes import Scheme\n"
        "from tests.backends.test_schemes import build\n"
        "SCHEME = Scheme(build, frozenset({'label'}))\n"
    )
    with installed(tmp_path, "extscheme", source, "ckptstore.backends", "text = extscheme:SCHEME"):
        assert "text" not in known()
        state = {"b": np.ones(3, np.int32)}
        asyncio.run(ckptstore.save("text://bkt/p", state, step=2))
        assert asyncio.run(ckptstore.restore("text://bkt/p", 2))["b"].tolist() == [1, 1, 1]
        assert parse_url("text://bkt/p")[0] == "text" and BUILT[-1][:2] == ("bkt", "p")
