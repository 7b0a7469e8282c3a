from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.backends.registry import load_profile, parse_url
from ckptstore.errors import ConfigError, InvalidURLError

PROFILES = Path(__file__).resolve().parents[2] / "backends"


@pytest.mark.parametrize(
    ("url", "kind", "location"),
    [
        ("/abs/path", "local", ("/abs/path", "")),
        ("file:///abs/path", "local", ("/abs/path", "")),
        ("memory://scratch", "memory", ("scratch", "")),
        ("s3://bucket/some/prefix/", "s3", ("bucket", "some/prefix")),
        ("s3://bucket", "s3", ("bucket", "")),
        ("gs://bucket/p", "gcs", ("bucket", "p")),
        ("gcs://bucket/p", "gcs", ("bucket", "p")),
    ],
)
def test_parse_url(url: str, kind: str, location: tuple[str, str]) -> None:
    assert parse_url(url) == (kind, location)


def test_relative_path_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    backend = ckptstore.open_backend("ckpts")
    assert isinstance(backend, LocalBackend)
    assert backend.root == tmp_path / "ckpts"


@pytest.mark.parametrize(
    "url", ["ftp://host/x", "s3://", "file://host/x", "s3://b/p?x=1", "", "s3://user:pw@b/p"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        ckptstore.open_backend(url)
    assert "pw" not in str(info.value)


def test_secret_in_url_never_echoed() -> None:
    with pytest.raises(InvalidURLError) as info:
        ckptstore.open_backend("https://AKIAXXX:sup3rsecret@host/x")
    assert "sup3rsecret" not in str(info.value)


def test_unknown_option_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="region"):
        ckptstore.open_backend(str(tmp_path), region="us-east-1")


def test_retry_option_forms(tmp_path: Path) -> None:
    b = ckptstore.open_backend(str(tmp_path), retry=3)
    assert b.retry.max_attempts == 3
    b = ckptstore.open_backend(str(tmp_path), retry={"max_attempts": 2, "base_delay": 0.5})
    assert (b.retry.max_attempts, b.retry.base_delay) == (2, 0.5)
    with pytest.raises(ConfigError):
        ckptstore.open_backend(str(tmp_path), retry={"attempts": 2})
    with pytest.raises(ConfigError):
        ckptstore.open_backend(str(tmp_path), retry=0)


def test_memory_url() -> None:
    backend = ckptstore.open_backend("memory://registry-test", concurrency=4)
    assert isinstance(backend, MemoryBackend)
    assert backend.url == "memory://registry-test"
    assert backend.concurrency == 4


BACKEND_PROFILES = [p for p in sorted(PROFILES.glob("*.toml")) if "tiers" not in load_profile(p)]


@pytest.mark.parametrize("profile", BACKEND_PROFILES, ids=lambda p: p.name)
def test_example_profiles_load_and_open(
    profile: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSTORE_NVME_ROOT", str(tmp_path))  # nvme-scratch: an existing root
    loaded = load_profile(profile)
    backend = ckptstore.open_backend(profile=profile)
    kind = parse_url(loaded["url"])[0]
    assert backend.kind == kind
    if "concurrency" in loaded["options"]:
        assert backend.concurrency == loaded["options"]["concurrency"]


def test_example_profiles_cover_each_environment() -> None:
    names = {p.stem for p in PROFILES.glob("*.toml")}
    assert {"local", "nvme-scratch", "s3", "gcs", "moto", "nvme-s3-tiered"} <= names


def test_the_tiered_example_profile_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiered = ckptstore.Tiered.from_profile(PROFILES / "nvme-s3-tiered.toml")
    assert tiered.keep_fast == 2 and tiered.free_margin == 1 << 30
    assert tiered.fast == str(PROFILES / "nvme-scratch.toml")
    assert ckptstore.open_backend(profile=tiered.durable).kind == "s3"
    monkeypatch.setenv("CKPTSTORE_NVME_ROOT", str(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir()  # create = false: the volume must be there
    assert ckptstore.open_backend(profile=tiered.fast).kind == "local"
    options = ckptstore.ManagerOptions.from_table(
        load_profile(PROFILES / "nvme-s3-tiered.toml")["manager"]
    )
    assert isinstance(options.save_policy, ckptstore.policies.AnyOf)
    assert isinstance(options.keep_policy, ckptstore.policies.KeepLatest)


def test_profile_env_expansion_and_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text('url = "${ROOT_FOR_TEST}/ck"\n[options]\nconcurrency = 3\nfsync = false\n')
    monkeypatch.setenv("ROOT_FOR_TEST", str(tmp_path))
    backend = ckptstore.open_backend(profile=profile, concurrency=7)
    assert isinstance(backend, LocalBackend)
    assert backend.root == tmp_path / "ck"
    assert backend.concurrency == 7 and backend.fsync is False
    monkeypatch.setenv("CKPTSTORE_PROFILE", str(profile))
    assert ckptstore.open_backend().concurrency == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('url = "s3://b/p"\n[options]\nsecret_key = "x"\n', "secret_key"),
        ("url = [1]\n", "url"),
        ('url = "${SURELY_UNSET_VAR_123}"\n', "SURELY_UNSET_VAR_123"),
        ("url = \n", "TOML"),
        ('url = "/x"\nbackend = "s3"\n', "backend"),
    ],
)
def test_bad_profiles(tmp_path: Path, text: str, match: str) -> None:
    profile = tmp_path / "bad.toml"
    profile.write_text(text)
    with pytest.raises(ConfigError, match=match):
        ckptstore.open_backend(profile=profile)


def test_missing_profile(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ckptstore.open_backend(profile=tmp_path / "nope.toml")


def test_nothing_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_PROFILE", raising=False)
    with pytest.raises(InvalidURLError, match="CKPTSTORE_PROFILE"):
        ckptstore.open_backend()


@pytest.mark.parametrize("concurrency", [0, -1, True, 2.5])
@pytest.mark.parametrize("url", ["/tmp/ckptstore-never", "memory://conc", "s3://bucket/p"])
def test_bad_concurrency_is_refused_not_a_hang(url: str, concurrency: Any) -> None:
    with pytest.raises(ckptstore.ConfigError, match="concurrency"):
        ckptstore.open_backend(url, concurrency=concurrency)


def test_memory_urls_need_a_name() -> None:
    with pytest.raises(ckptstore.InvalidURLError, match="names no store"):
        ckptstore.open_backend("memory://")
    ckptstore.save_sync("memory://named-store", {"x": np.arange(3)}, step=1)
    assert ckptstore.list_steps_sync("memory://named-store") == [1]


def test_a_missing_profile_is_an_error_not_a_new_directory(tmp_path: Path) -> None:
    missing = tmp_path / "prod.toml"
    with pytest.raises(ckptstore.ConfigError, match="does not exist"):
        ckptstore.save_sync(str(missing), {"x": np.arange(3)}, step=1)
    assert not missing.exists()


@pytest.mark.parametrize(
    "url, secret",
    [
        ("s3://bucket/p", "AKIAXXXXSECRETXXXX"),
        ("gs://bucket/p", '{"type": "service_account", "private_key": "SECRET"}'),
    ],
)
def test_a_secret_passed_as_credentials_is_not_echoed(url: str, secret: str) -> None:
    with pytest.raises(ckptstore.ConfigError) as info:
        ckptstore.open_backend(url, credentials=secret)
    assert "SECRET" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "s3://b/x?X-Amz-Signature=SIGSECRET&X-Amz-Credential=AKIASECRET",
        "gs://b/x?pw=SIGSECRET",
        "s3://b/x#SIGSECRET",
        "memory://m?token=SIGSECRET",
    ],
)
def test_a_signed_query_string_is_never_echoed(url: str) -> None:
    with pytest.raises(InvalidURLError, match="query strings") as info:
        ckptstore.open_backend(url)
    assert "SECRET" not in str(info.value) and "?***" in str(info.value)


#: Every profile option by the type it takes, and TOML values of other types.
_WRONG = {
    "str": ["[1]", "{ a = 1 }", "true", "1.5"],
    "bool": ['"yes"', "1", "[true]"],
    "int": ['"2"', "1.5", "true", "[1]"],
    "seconds": ['"2"', "true", "inf", "nan", "[1]"],
}
_TYPED_OPTIONS = {
    "local": {"concurrency": "int", "fsync": "bool", "drop_cache": "bool", "create": "bool"},
    "memory": {"concurrency": "int"},
    "s3": {
        "endpoint": "str",
        "region": "str",
        "credentials": "str",
        "profile": "str",
        "multipart_threshold": "int",
        "part_size": "int",
        "read_part_size": "int",
        "read_concurrency": "int",
        "ts_request_concurrency": "int",
        "connect_timeout": "seconds",
        "read_timeout": "seconds",
    },
    "gcs": {
        "endpoint": "str",
        "project": "str",
        "credentials": "str",
        "emulator": "bool",
        "resumable_threshold": "int",
        "chunk_size": "int",
    },
}
_RETRY = {"max_attempts": "int", "base_delay": "seconds", "max_delay": "seconds"}
_URLS = {"local": "ROOT", "memory": "memory://m", "s3": "s3://b/p", "gcs": "gs://b/p"}


def _wrong_typed_options() -> list[tuple[str, str, str]]:
    cases = []
    for kind, options in _TYPED_OPTIONS.items():
        for name, want in options.items():
            cases += [(kind, f"[options]\n{name}", value) for value in _WRONG[want]]
        for name, want in _RETRY.items():
            cases += [(kind, f"[options.retry]\n{name}", value) for value in _WRONG[want]]
        cases += [(kind, "[options]\nretry", value) for value in ('"many"', "1.5", "[1]")]
    return cases


@pytest.mark.parametrize(("kind", "field", "value"), _wrong_typed_options())
def test_every_option_of_the_wrong_type_is_named(
    kind: str, field: str, value: str, tmp_path: Path
) -> None:
    """Profiles are checked field by field: a value of the wrong type is a `ConfigError`
    naming the field and what it takes, never a TypeError from deeper down."""
    table, name = field.split("\n")
    url = _URLS[kind].replace("ROOT", str(tmp_path / "ck"))
    profile = tmp_path / "p.toml"
    profile.write_text(f'url = "{url}"\n{table}\n{name} = {value}\n')
    with pytest.raises(ConfigError) as info:
        ckptstore.open_backend(profile=profile)
    assert name in str(info.value) and "must be" in str(info.value)
    assert "retry]" not in table or "[options.retry]" in str(info.value)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('keep_fast = "2"', "keep_fast must be a number of steps"),
        ("keep_fast = 1.5", "keep_fast must be a number of steps"),
        ("keep_fast = true", "keep_fast must be a number of steps"),
        ('free_margin = "1G"', "free_margin must be bytes"),
    ],
)
def test_tiers_fields_of_the_wrong_type_are_named(line: str, match: str, tmp_path: Path) -> None:
    profile = tmp_path / "t.toml"
    profile.write_text(f'[tiers]\nfast = "f"\ndurable = "d"\n{line}\n')
    with pytest.raises(ConfigError, match=match):
        ckptstore.Tiered.from_profile(profile)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"save_initial": "no"}, "save_initial must be true or false"),
        ({"save_on_preemption": 1}, "save_on_preemption must be true or false"),
        ({"gc_on_start": "yes"}, "gc_on_start must be true or false"),
        ({"if_busy": ["wait"]}, "if_busy must be a string"),
        ({"keep_best": {"metric": 3}}, "keep_best.metric must be a string"),
        ({"keep_latest": "3"}, "keep_latest must be an integer"),
    ],
)
def test_manager_fields_of_the_wrong_type_are_named(table: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ckptstore.ManagerOptions.from_table(table)
