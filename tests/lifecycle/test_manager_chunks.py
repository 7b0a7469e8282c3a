"""`ManagerOptions(incremental=True, chunk_bytes=...)`: a training loop's sparsely updated
table is saved chunk by chunk, each save writing the chunks that changed
(docs/incremental.md, "Chunk references")."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import ckptstore


def test_a_manager_saves_a_sparsely_updated_table_chunk_by_chunk(tmp_path: Path) -> None:
    options = ckptstore.ManagerOptions(
        incremental=True, chunk_bytes=4096, handle_sigterm=False, gc_on_start=False
    )
    table = np.random.default_rng(0).standard_normal((1024, 64), dtype=np.float32)
    with ckptstore.CheckpointManager(tmp_path / "run", options=options) as mgr:
        for step in (1, 2, 3):
            table = table.copy()
            table[100 * step] += 1.0  # one row: the 2 chunks of 32 x 32 across it
            handle = mgr.save(step, {"emb": jax.device_put(table)})
            assert handle is not None
            stats = handle.wait()
            if step > 1:
                assert stats.bytes_written == 2 * 4096, stats
        manifest = ckptstore.read_manifest_sync(tmp_path / "run", 3)
        assert manifest.items["state"].chunk_refs["emb"].count == 62
        got = mgr.restore(3)
    np.testing.assert_array_equal(got["emb"], table)


def test_chunk_bytes_is_checked(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True, "4096"):
        with pytest.raises(ckptstore.ConfigError, match="chunk_bytes"):
            ckptstore.ManagerOptions(chunk_bytes=bad)  # type: ignore[arg-type]
    profile = tmp_path / "run.toml"
    profile.write_text(f'url = "{tmp_path / "run"}"\n[manager]\nchunk_bytes = 65536\n')
    with ckptstore.CheckpointManager(str(profile)) as mgr:
        assert mgr.options.chunk_bytes == 65536
