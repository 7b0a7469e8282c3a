"""What a process keeps between backends of one credential source: a few SDK sessions or
credentials (`awssession`, `gcscreds`), in a small thread-safe table that drops the least
recently used, keyed by what they depend on; the environment goes in as a digest
(`environment_digest`), never as its values."""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Kept(Generic[K, V]):
    """At most ``size`` values by key; the least recently used goes first."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._values: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value kept for ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._values.get(key)
            if found is not None:
                self._values.move_to_end(key)
            return found

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key``, dropping the least recently used beyond ``size``."""
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self._values))


def environment_digest(*prefixes: str) -> str:
    """A digest of every environment variable whose name starts with one of ``prefixes``
    (names and values)."""
    found = sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))
    return hashlib.sha256(repr(found).encode()).hexdigest()
