"""Google credentials for `GcsBackend`, shared while their source stays the same.

Every ``save("gs://...")`` opens a backend, and each backend builds its own gcsfs
filesystem. Given a credential source (``"default"`` or a key file), gcsfs makes new
credentials for each: application default credentials looked up again (on Google Cloud,
the metadata server asked), and a new access token fetched before the first request (from
Google's token endpoint, or the metadata server, which limits how often it may be asked).
The credentials made for a source are kept here and handed to the next backend's
filesystem, so a process fetches a token per source once an hour (when it expires), not
once per save. Kept per source and the process's ``GOOGLE_*`` and ``CLOUDSDK_*``
environment (default credentials follow it), and for a key file its path and content (a
rotated key makes new credentials); only digests of those are kept, never a value.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ckptstore.backends.kept import Kept, environment_digest

#: Credentials kept at most (the oldest goes first).
KEPT = 8

_kept: Kept[str, Any] = Kept(KEPT)


def source_key(source: str) -> str:
    """What credentials made for ``source`` (``"default"`` or a key file's path) depend
    on, as a digest: the source, the environment default credentials follow, and a key
    file's resolved path and content. OSError if the key file cannot be read."""
    parts = [source, environment_digest("GOOGLE_", "CLOUDSDK_")]
    if source != "default":
        path = Path(source).expanduser().resolve()
        parts += [str(path), hashlib.sha256(path.read_bytes()).hexdigest()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def kept(key: str) -> Any:
    """The credentials `keep` kept under ``key``, or None."""
    return _kept.get(key)


def keep(key: str, credentials: Any) -> None:
    """Keep ``credentials`` (google-auth's, as a gcsfs filesystem made them) for ``key``."""
    if credentials is not None:  # anonymous: nothing to share
        _kept.put(key, credentials)
