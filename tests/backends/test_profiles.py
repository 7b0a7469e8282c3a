"""Profiles everywhere: by path or by name, $CKPTSTORE_PROFILE wherever a target may be
omitted, paths relative to the profile's file, and ``create = false``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.registry import load_profile, resolve_profile
from ckptstore.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "backends"


@pytest.fixture
def profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A profiles directory with ``local.toml`` (a relative URL) in $CKPTSTORE_PROFILES_DIR;
    the working directory is elsewhere."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "local.toml").write_text('url = "ckpt"\n[options]\nfsync = false\n')
    monkeypatch.setenv("CKPTSTORE_PROFILES_DIR", str(folder))
    monkeypatch.delenv("CKPTSTORE_PROFILE", raising=False)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return folder


def test_a_profile_by_name(profiles: Path) -> None:
    backend = ckptstore.open_backend(profile="local")
    assert isinstance(backend, LocalBackend)
    assert backend.root == profiles / "ckpt" and backend.fsync is False
    with pytest.raises(ConfigError, match=f"no profile named 'prod': {profiles}/prod.toml"):
        ckptstore.open_backend(profile="prod")


def test_the_default_profiles_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_PROFILES_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    folder = tmp_path / "ckptstore" / "profiles"
    folder.mkdir(parents=True)
    (folder / "mem.toml").write_text('url = "memory://by-name"\n')
    assert resolve_profile("mem") == folder / "mem.toml"
    assert ckptstore.open_backend(profile="mem").url == "memory://by-name"
    assert resolve_profile("sub/mem") == Path("sub/mem")  # a path, not a name


def test_env_profile_wherever_the_target_is_omitted(
    profiles: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSTORE_PROFILE", "local")
    tree = {"w": np.arange(6, dtype=np.float32)}
    ckptstore.save_sync(None, tree, step=4)
    assert ckptstore.list_steps_sync(None) == [4]
    np.testing.assert_array_equal(ckptstore.restore_sync(None)["w"], tree["w"])
    assert ckptstore.verify_sync(None).ok
    assert ckptstore.list_steps_sync(str(profiles / "ckpt")) == [4]  # where the profile says
    monkeypatch.setenv("CKPTSTORE_PROFILE", str(profiles / "local.toml"))  # a path works too
    assert ckptstore.open_backend().root == profiles / "ckpt"
    monkeypatch.delenv("CKPTSTORE_PROFILE")
    with pytest.raises(ckptstore.InvalidURLError, match="CKPTSTORE_PROFILE"):
        ckptstore.list_steps_sync(None)


def test_relative_paths_resolve_against_the_profile(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    file = tmp_path / "conf" / "tiers.toml"
    file.write_text('[tiers]\nfast = "../nvme"\ndurable = "durable.toml"\n')
    tiers = load_profile(file)["tiers"]
    assert tiers["fast"] == str(tmp_path / "conf" / "../nvme")
    assert tiers["durable"] == str(tmp_path / "conf" / "durable.toml")
    (tmp_path / "conf" / "abs.toml").write_text('url = "/srv/ckpt"\n')
    assert load_profile(tmp_path / "conf" / "abs.toml")["url"] == "/srv/ckpt"


def test_create_false_refuses_a_missing_root(tmp_path: Path) -> None:
    file = tmp_path / "scratch.toml"
    file.write_text('url = "mnt/ckpt"\n[options]\ncreate = false\n')
    with pytest.raises(ConfigError, match=f"{tmp_path}/mnt/ckpt does not exist .*create = false"):
        ckptstore.save_sync(str(file), {"x": np.arange(2)}, step=1)
    assert not (tmp_path / "mnt").exists()
    (tmp_path / "mnt" / "ckpt").mkdir(parents=True)
    ckptstore.save_sync(str(file), {"x": np.arange(2)}, step=1)
    assert ckptstore.list_steps_sync(str(tmp_path / "mnt" / "ckpt")) == [1]


def test_the_nvme_example_refuses_an_unmounted_volume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSTORE_NVME_ROOT", str(tmp_path / "unmounted" / "ckptstore"))
    with pytest.raises(ConfigError, match="unmounted/ckptstore does not exist"):
        ckptstore.open_backend(profile=EXAMPLES / "nvme-scratch.toml")
    assert not (tmp_path / "unmounted").exists()
    monkeypatch.setenv("CKPTSTORE_NVME_ROOT", str(tmp_path))
    assert ckptstore.open_backend(profile=EXAMPLES / "nvme-scratch.toml").kind == "local"


def test_a_bare_name_of_a_profile_is_that_profile_everywhere(
    profiles: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule in Python and the CLI: a bare name with a profile of that name is the
    profile (its storage, its [manager] table), never a directory of that name beside
    the caller; a name that is both is refused, naming both."""
    from ckptstore.cli import main

    (profiles / "local.toml").write_text(
        'url = "ckpt"\n[options]\nfsync = false\n[manager]\nstaging = "host"\n'
    )
    tree = {"w": np.arange(6, dtype=np.float32)}
    ckptstore.save_sync("local", tree, step=1)
    with ckptstore.CheckpointManager("local", options=None) as mgr:
        assert mgr.options.staging == "host"  # the profile's [manager] table
        handle = mgr.save(2, tree, force=True)
        assert handle is not None and handle.wait().staging_mode == "host"
    assert not Path("local").exists()  # nothing written beside the caller
    assert ckptstore.list_steps_sync(str(profiles / "ckpt")) == [1, 2]
    assert ckptstore.list_steps_sync("local") == [1, 2]
    capsys.readouterr()
    assert main(["ls", "local"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "2"], rows  # the profile's steps
    assert ckptstore.list_steps_sync("nothing-named-so") == []  # no profile: a directory
    Path("local").mkdir()
    with pytest.raises(ConfigError, match=r"'local' names both the profile .*local.toml and "):
        ckptstore.list_steps_sync("local")
    with pytest.raises(ConfigError, match="names both"):
        ckptstore.CheckpointManager("local")
    assert main(["ls", "local"]) == 2
    assert "names both" in capsys.readouterr().err
    assert ckptstore.list_steps_sync("./local") == []  # the directory, asked for as a path
