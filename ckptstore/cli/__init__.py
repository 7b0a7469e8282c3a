"""The ``ckptstore`` command (``ckptstore --help``, docs/cli.md), one module per command
group: `main` (the parser, dispatch, errors; ``import-safetensors``), `steps` (``ls``,
``info``, ``verify``), `remove` (``rm``, ``gc``), `tiers` (``promote``, ``ls`` of a tiered
profile), `orbax` (``export-orbax``, ``import-orbax``, and ``ls``/``info``/``verify`` of
Orbax checkpoints); `output` (exit statuses, ``--json``, the progress line) and `text`
(how sizes, counts and times are printed) serve them all.
"""

from __future__ import annotations

from ckptstore.cli.main import SIGPIPE_EXIT, main

__all__ = ["SIGPIPE_EXIT", "main"]
