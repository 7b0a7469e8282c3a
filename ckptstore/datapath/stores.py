"""What the data path's readers and writers share: the OCDBT store a process writes
its leaves into, and how many bytes of leaf data a read or a write holds at once."""

from __future__ import annotations

from typing import Any

#: Bytes of host copies of shard data a save hands to TensorStore at once, and of read data
#: a restore holds for its devices at once; bounds their memory. Shards already in host
#: memory (CPU devices) are written without a copy.
MAX_INFLIGHT_BYTES = 256 << 20
#: OCDBT starts writing a data file once it holds this many bytes, so a save's data files
#: are written (and fsync'd) in parallel while later chunks are still being encoded,
#: instead of one big file per commit (TensorStore's default target is 2 GiB). Chosen
#: against larger targets with `benchmarks/data_files.py` (local disk) and
#: `benchmarks/object_reads.py` (S3 and GCS emulators); docs/benchmarks.md has the figures.
DATA_FILE_BYTES = 16 << 20


#: The OCDBT configuration of every store a save writes: TensorStore's defaults, spelled out
#: so that a writer can assume it (`ocdbt_spec`'s ``fresh``). A store found with another
#: configuration fails the write (FAILED_PRECONDITION), never takes it mixed.
OCDBT_CONFIG: dict[str, Any] = {
    "compression": {"id": "zstd"},
    "max_decoded_node_bytes": 8 << 20,
    "max_inline_value_bytes": 100,
    "version_tree_arity_log2": 4,
}


def ocdbt_spec(base: dict[str, Any], *, fresh: bool = False) -> dict[str, Any]:
    """An OCDBT store on top of a backend's kvstore spec. ``fresh``: a store this writer
    creates (a save's own stores), whose configuration is `OCDBT_CONFIG`, assumed rather
    than created by a commit of its own (an OCDBT store otherwise writes its manifest once
    before the first data: a durable write, fsyncs included, per store and save)."""
    spec = {"driver": "ocdbt", "base": base, "target_data_file_size": DATA_FILE_BYTES}
    if fresh:
        spec.update(config=OCDBT_CONFIG, assume_config=True)
    return spec
