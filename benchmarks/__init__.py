"""Benchmarks for ckptstore (run as scripts: ``python benchmarks/storage.py``)."""
