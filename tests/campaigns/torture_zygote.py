"""Imported by the torture campaign's zygote only (tests/campaigns/torture_worker.py, PRELOAD):
parse botocore's S3 models once, for every worker forked from it.

Each worker's first S3 call builds a client, which parses ~0.6 s of JSON models; every
botocore session takes its loader from ``botocore.session.create_loader``, so handing them
one loader that already holds the models makes that a fork's copy-on-write memory. Never
imported by the driver, whose botocore stays as it is.
"""

from __future__ import annotations

import botocore.session

_loader = botocore.session.create_loader()
botocore.session.create_loader = lambda search_paths=None: _loader  # type: ignore[assignment]
botocore.session.get_session().create_client(
    "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
).close()
