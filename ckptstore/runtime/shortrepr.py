"""Abbreviated reprs of jax arrays that never copy them to the host.

``asyncio.run(ckptstore.restore(...))`` was 2-3x slower than `restore_sync` on Python 3.11:
when its task ends, `asyncio.Runner.run` checks whether the SIGINT handler is still its own,
``functools.partial(Runner._on_sigint, main_task=task)``, with `signal.getsignal`. That
converts the handler to a `signal.Handlers` member by calling ``Handlers(handler)``, which
fails and builds its ValueError message with ``%r`` of the partial: the task's repr, whose
``result=`` is `reprlib.repr` of the restored tree. `reprlib` abbreviates containers but asks
each jax array for its full repr, and a jax array's repr copies the whole array to the host
(and keeps that copy): seconds and the tree's size in memory for a large tree, after the
restore itself was done, on every call (docs/benchmarks.md, "The natural async form").

`install` gives `reprlib`'s shared `Repr` (the one asyncio's task and future reprs use) a
``repr_<type>`` method for jax's array types, as `reprlib` documents for types of one's
own: ``<jax.Array float32[8192,3472]>``, from the shape and dtype alone. Full reprs
(``repr(array)``, ``print``) are unchanged.
"""

from __future__ import annotations

import reprlib
from typing import Any

#: jax's array classes, by `type(x).__name__` (how `reprlib` dispatches).
_ARRAY_TYPES = ("ArrayImpl", "PRNGKeyArray")


def short(value: Any, level: int = 0) -> str:
    """``<jax.Array float32[8,4]>``: what an abbreviated repr needs, read from metadata only."""
    shape = ",".join(str(d) for d in getattr(value, "shape", ()))
    return f"<jax.Array {getattr(value, 'dtype', '?')}[{shape}]>"


def install() -> None:
    """Make `reprlib.repr` (asyncio's task reprs) describe jax arrays without reading them."""
    for name in _ARRAY_TYPES:
        if not hasattr(reprlib.aRepr, f"repr_{name}"):
            setattr(reprlib.aRepr, f"repr_{name}", short)
