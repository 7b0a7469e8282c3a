"""Blocking twins of the async API, for scripts and notebooks.

They run the coroutine on one private event-loop thread, so they work whether
or not the caller already runs an event loop, and backends opened for them
stay on one loop. Ctrl-C (or any exception raised in the waiting thread, such as
`KeyboardInterrupt`) cancels the running work and waits until it has stopped
before it propagates: nothing keeps writing behind the caller's back. A second
Ctrl-C while that cancellation runs stops waiting for it.

The twins of `ckptstore.promote`, `export_orbax` and `import_orbax` live beside
them (`lifecycle.tiers`, `importers`), as this layer must not import those.

Every twin is made by `blocking` from its async function, so it has that function's
parameters and types: `inspect.signature`, ``help()``, IDEs and mypy see them
(``save_sync(root, tree, step="3")`` is a type error, as it is for ``save``).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ckptstore.checkpoint.cleanup import delete_step, gc
from ckptstore.checkpoint.partial import Part, PartialSave, partial_save
from ckptstore.checkpoint.save import SaveResult, save
from ckptstore.format.leaves import LeafInfo
from ckptstore.runtime.blocking import blocking, run
from ckptstore.tiers.read import list_steps, read_manifest, restore, verify

save_sync = blocking(save)
restore_sync = blocking(restore)
list_steps_sync = blocking(list_steps)
verify_sync = blocking(verify)
read_manifest_sync = blocking(read_manifest)
delete_step_sync = blocking(delete_step)
gc_sync = blocking(gc)


class PartialSaveSync:
    """A `PartialSave` session with blocking methods (``with`` closes it, as ``async with``
    closes the async one)."""

    def __init__(self, session: PartialSave):
        self.session = session

    @property
    def step(self) -> int:
        return self.session.step

    @property
    def attempt(self) -> str:
        """See `PartialSave.attempt`."""
        return self.session.attempt

    @property
    def parts(self) -> list[Part]:
        """The parts recorded so far."""
        return self.session.parts

    @property
    def leaves(self) -> dict[str, LeafInfo]:
        """See `PartialSave.leaves`."""
        return self.session.leaves

    def add(self, subtree: Any, *, replace: bool = False) -> Part:
        """`PartialSave.add`, blocking."""
        return run(self.session.add(subtree, replace=replace))

    def drop(self, index: int) -> None:
        """`PartialSave.drop`, blocking."""
        run(self.session.drop(index))

    def abandon(self) -> None:
        """`PartialSave.abandon`, blocking."""
        run(self.session.abandon())

    def finalize(
        self, *, metadata: dict[str, Any] | None = None, structure: dict[str, Any] | None = None
    ) -> SaveResult:
        """`PartialSave.finalize`, blocking."""
        return run(self.session.finalize(metadata=metadata, structure=structure))

    def close(self) -> None:
        """`PartialSave.close`, blocking."""
        run(self.session.close())

    def __enter__(self) -> PartialSaveSync:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PartialSaveSync step {self.step} attempt {self.attempt}>"


#: A session whose methods block (`PartialSaveSync`).
partial_save_sync = blocking(partial_save, PartialSaveSync)
