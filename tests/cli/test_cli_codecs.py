"""``ckptstore info`` shows each leaf's codec and its stored bytes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import main


def test_info_shows_codecs_and_stored_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path)
    zeros = np.zeros((1024, 2048), np.float32)  # 8 MiB of zeros: a few KiB compressed
    tree = {"big": zeros, "small": np.zeros(1000, np.float32), "raw": np.arange(4, dtype=np.int32)}
    ckptstore.save_sync(root, tree, step=1, codecs={"big": "zstd:3", "small": "zstd:1"})
    capsys.readouterr()
    assert main(["info", root, "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)["stored"]["state"]
    assert stored["big"]["codec"] == "zstd:3" and stored["small"]["codec"] == "zstd:1"
    assert stored["raw"] == {"codec": "none", "stored_bytes": 16 + 4}
    assert 0 < stored["big"]["stored_bytes"] < 64 << 10
    assert 0 < stored["small"]["stored_bytes"] < 1000
    assert main(["info", root]) == 0
    text = capsys.readouterr().out
    big, small = stored["big"]["stored_bytes"], stored["small"]["stored_bytes"]
    assert re.search(rf"^  big +float32 +1024x2048 +8\.0 MiB +zstd:3 +{big} B +-$", text, re.M)
    assert re.search(rf"^  small +float32 +1000 +3\.9 KiB +zstd:1 +{small} B +-$", text, re.M)
    assert re.search(r"^  raw +int32 +4 +16 B +none +20 B +-$", text, re.M), text


def test_info_says_which_leaves_were_cast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = {"mu": np.ones(100, np.float32), "w": np.ones(100, np.float32)}
    ckptstore.save_sync(str(tmp_path), tree, step=1, casts={"mu": "bfloat16"})
    capsys.readouterr()
    assert main(["info", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert re.search(
        r"^  mu +bfloat16 +100 +200 B +none +204 B +-  \(cast from float32\)$", text, re.M
    )
    assert re.search(r"^  w +float32 +100 +400 B +none +404 B +-$", text, re.M), text
