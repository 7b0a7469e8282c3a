"""A failure published to the other processes comes back there as the most specific type
they act on: a lost commit race as `AlreadyExistsError`, an outage as
`TransientStorageError` (every process defers the promotion alike)."""

from __future__ import annotations

import json

import pytest

from ckptstore import errors
from ckptstore.runtime.handoff import _failure, _remote_error


class ThrottledError(errors.TransientStorageError):
    """A backend's own transient error, a type the other processes do not know."""


@pytest.mark.parametrize(
    ("raised", "rebuilt"),
    [
        (errors.RetriesExhaustedError("gave up"), errors.RetriesExhaustedError),
        (ThrottledError("503"), errors.TransientStorageError),
        (errors.FencedError("deleted meanwhile"), errors.FencedError),
        (errors.AlreadyExistsError("committed"), errors.AlreadyExistsError),
        (errors.BaseStepGoneError("gone"), errors.BaseStepGoneError),
        (errors.InsufficientSpaceError("full"), errors.InsufficientSpaceError),
        (RuntimeError("disk on fire"), errors.CkptStoreError),
    ],
)
def test_a_published_failure_keeps_the_type_others_act_on(
    raised: Exception, rebuilt: type[Exception]
) -> None:
    remote = _remote_error(json.loads(_failure(raised)), "process 1 failed")
    assert type(remote) is rebuilt
    assert type(raised).__name__ in str(remote) and str(raised) in str(remote)
