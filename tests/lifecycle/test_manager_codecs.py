"""The manager's codecs: from `ManagerOptions` and from a profile's ``[manager]`` table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.format.codecs import CodecPolicy, Zstd


def tree(step: int) -> dict[str, np.ndarray]:
    return {
        "params": {"w": np.zeros((512, 512), np.float32) + step, "b": np.arange(8.0)},
        "opt": {"mu": np.full((64,), step, np.float32)},
    }


def saved_codecs(root: Path, step: int) -> dict[str, Zstd | None]:
    leaves = ckptstore.read_manifest_sync(str(root), step).items["state"].leaves
    return {name: info.codec for name, info in leaves.items()}


def test_manager_options_codecs_reach_every_save(tmp_path: Path) -> None:
    options = ckptstore.ManagerOptions(codecs={"params/*": ckptstore.Zstd(2)}, handle_sigterm=False)
    assert options.codecs == CodecPolicy(rules=(("params/*", Zstd(2)),))
    with ckptstore.CheckpointManager(str(tmp_path), options=options) as mgr:
        for step in (1, 2):
            handle = mgr.save(step, tree(step))
            assert handle is not None
            handle.wait()
    for step in (1, 2):
        assert saved_codecs(tmp_path, step) == {
            "params/w": Zstd(2),
            "params/b": Zstd(2),
            "opt/mu": None,
        }
        got = ckptstore.restore_sync(str(tmp_path), step)
        assert got["params"]["w"].tobytes() == tree(step)["params"]["w"].tobytes()


def test_codecs_from_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "run.toml"
    profile.write_text(
        f'url = "{tmp_path / "run"}"\n[manager]\nhandle_sigterm = false\n'
        '[manager.codecs]\n"opt/*" = "zstd:1"\n"*" = "zstd:4"\n'
    )
    with ckptstore.CheckpointManager(str(profile)) as mgr:
        handle = mgr.save(1, tree(1))
        assert handle is not None
        handle.wait()
    assert saved_codecs(tmp_path / "run", 1) == {
        "params/w": Zstd(4),
        "params/b": Zstd(4),
        "opt/mu": Zstd(1),
    }
    profile.write_text(f'url = "{tmp_path / "run"}"\n[manager]\ncodecs = "zstd:9"\n')
    assert ckptstore.load_profile(str(profile))["manager"]["codecs"] == "zstd:9"
    with ckptstore.CheckpointManager(str(profile)) as mgr:
        assert mgr.options.codecs == CodecPolicy(default=Zstd(9))


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ('codecs = "snappy"', r"\[manager\]\.codecs: unknown codec 'snappy'"),
        ('codecs = "zstd:30"', "1 to 22, got 30"),
        ("codecs = 3", "must be a codec such as 'zstd:3'"),
        ('[manager.codecs]\n"w" = 5', r"\[manager\]\.codecs\['w'\]: a codec is"),
    ],
)
def test_bad_codecs_in_a_profile_are_config_errors(tmp_path: Path, table: str, said: str) -> None:
    profile = tmp_path / "run.toml"
    profile.write_text(f'url = "{tmp_path / "run"}"\n[manager]\n{table}\n')
    with pytest.raises(ckptstore.ConfigError, match=said):
        ckptstore.CheckpointManager(str(profile))
    with pytest.raises(ckptstore.ConfigError, match="unknown codec"):
        ckptstore.ManagerOptions(codecs="gzip")


def test_casts_from_a_profile_reach_the_managers_saves(tmp_path: Path) -> None:
    profile = tmp_path / "run.toml"
    profile.write_text(
        f'url = "{tmp_path / "run"}"\n[manager]\nhandle_sigterm = false\n'
        '[manager.casts]\n"opt/*" = "bfloat16"\n'
    )
    with ckptstore.CheckpointManager(str(profile)) as mgr:
        assert mgr.options.casts == ckptstore.CastPolicy(rules=(("opt/*", "bfloat16"),))
        handle = mgr.save(1, tree(1))
        assert handle is not None
        handle.wait()
    leaves = ckptstore.read_manifest_sync(str(tmp_path / "run"), 1).items["state"].leaves
    assert (leaves["opt/mu"].dtype, leaves["opt/mu"].cast_from) == ("bfloat16", "float32")
    assert leaves["params/w"].cast_from is None
    got = ckptstore.restore_sync(str(tmp_path / "run"), 1)
    assert got["opt"]["mu"].dtype == np.float32  # 1.0 is exact in bfloat16
    assert got["opt"]["mu"].tobytes() == tree(1)["opt"]["mu"].tobytes()
    profile.write_text(f'url = "{tmp_path / "run"}"\n[manager]\ncasts = "bfloat16"\n')
    with pytest.raises(ckptstore.ConfigError, match="table of pattern = dtype"):
        ckptstore.CheckpointManager(str(profile))
