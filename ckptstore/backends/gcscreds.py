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

import collections
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

#: Credentials kept at most (the oldest goes first).
KEPT = 8

_kept: collections.OrderedDict[str, Any] = collections.OrderedDict()
_lock = threading.Lock()


def source_key(source: str) -> str:
    """What credentials made for ``source`` (``"default"`` or a key file's path) depend
    on, as a digest: the source, the environment default credentials follow, and a key
    file's resolved path and content. OSError if the key file cannot be read."""
    parts = [source, _environment()]
    if source != "default":
        path = Path(source).expanduser().resolve()
        parts += [str(path), hashlib.sha256(path.read_bytes()).hexdigest()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def kept(key: str) -> Any:
    """The credentials `keep` kept under ``key``, or None."""
    with _lock:
        found = _kept.get(key)
        if found is not None:
            _kept.move_to_end(key)
        return found


def keep(key: str, credentials: Any) -> None:
    """Keep ``credentials`` (google-auth's, as a gcsfs filesystem made them) for ``key``."""
    if credentials is None:  # anonymous: nothing to share
        return
    with _lock:
        _kept[key] = credentials
        _kept.move_to_end(key)
        while len(_kept) > KEPT:
            _kept.popitem(last=False)


def _environment() -> str:
    """A digest of every ``GOOGLE_*`` and ``CLOUDSDK_*`` variable (names and values)."""
    found = sorted((k, v) for k, v in os.environ.items() if k.startswith(("GOOGLE_", "CLOUDSDK_")))
    return hashlib.sha256(repr(found).encode()).hexdigest()
