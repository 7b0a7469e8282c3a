"""The ``ckptstore`` command (``ckptstore --help``), one module per command group:
`main` (the parser; ``ls``, ``info``, ``verify``, ``rm``, ``gc``, ``import-safetensors``),
`tiers` (``promote``, ``ls`` of a tiered profile), `orbax` (``export-orbax``,
``import-orbax``, and ``ls``/``info``/``verify`` of Orbax checkpoints), `text` (how sizes,
counts and times are printed).
"""

from __future__ import annotations

from ckptstore.cli.main import SIGPIPE_EXIT, main

__all__ = ["SIGPIPE_EXIT", "main"]
