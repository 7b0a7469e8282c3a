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


def ocdbt_spec(base: dict[str, Any]) -> dict[str, Any]:
    """An OCDBT store on top of a backend's kvstore spec."""
    return {"driver": "ocdbt", "base": base, "target_data_file_size": DATA_FILE_BYTES}
