"""Checkpoints: per-process writers, the reference-only merge, commit, restore."""
