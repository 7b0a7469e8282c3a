"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

import sys

from ckptstore.cli.main import main

sys.exit(main())
