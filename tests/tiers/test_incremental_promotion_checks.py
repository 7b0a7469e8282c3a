"""What the promotion of an incremental step checks on the fast tier (`promote_step`): its
own attempt's leaves, and the leaves it reads from an attempt copied for it; not the
leaves it reads from an attempt already durable (checked when that one was promoted), so
promoting a later step of a LoRA run reads what changed, not the frozen base again."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.checkpoint.target import open_target
from tests.checkpoint.helpers import assert_same, lora, shared_target
from tests.paths import committed_root, largest_data_file


@pytest.fixture
def tiered(tmp_path: Path) -> ckptstore.Tiered:
    return ckptstore.Tiered(fast=str(tmp_path / "nvme"), durable=str(tmp_path / "durable"))


def flip_a_byte(fast: str, root: str) -> None:
    """Damage the largest data file of attempt ``root`` (step 1's: the frozen leaves)."""
    data = largest_data_file(Path(fast, root, "state"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data.write_bytes(bytes(blob))


async def test_bytes_durable_already_are_not_checked_again(tiered: ckptstore.Tiered) -> None:
    """Step 1 promoted, then damaged on the fast tier: step 2, which reads its frozen
    leaves, still promotes (its durable copy reads step 1's durable copy, checked when
    promoted), restores bit-exact from there and verifies."""
    fast = ckptstore.open_backend(tiered.fast)
    await ckptstore.save(fast, lora(1), step=1)
    await ckptstore.promote(tiered, step=1)
    await ckptstore.save(fast, lora(2), step=2, base=1)
    flip_a_byte(str(tiered.fast), await committed_root(fast, 1))
    assert not (await ckptstore.verify(fast, step=2)).ok  # the fast copy is damaged
    (done,) = await ckptstore.promote(tiered, step=2)
    assert not done.bases and done.held_bytes == 0
    async with open_target(tiered.durable) as durable:
        assert_same(await ckptstore.restore(durable, step=2), lora(2))
        assert (await ckptstore.verify(durable, step=2)).ok


@pytest.mark.parametrize("kind", ["local", "s3"])
async def test_a_damaged_holder_copied_for_the_step_is_refused(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Step 1 deleted on the fast tier before any promotion, its bytes kept there for step
    2, and damaged: step 2's promotion, which would copy them, refuses before copying any
    of them, and the durable tier lists nothing."""
    tiered = ckptstore.Tiered(
        str(tmp_path / "nvme"), shared_target(kind, request, tmp_path, "durable")
    )
    fast = ckptstore.open_backend(tiered.fast)
    await ckptstore.save(fast, lora(1), step=1)
    await ckptstore.save(fast, lora(2), step=2, base=1)
    holder = await committed_root(fast, 1)
    await ckptstore.delete_step(fast, 1)
    flip_a_byte(str(tiered.fast), holder)
    with pytest.raises(ckptstore.CorruptCheckpointError, match="damaged on the fast tier"):
        await ckptstore.promote(tiered, step=2)
    async with open_target(tiered.durable) as durable:
        assert await ckptstore.list_steps(durable) == []
        copied = [o.key async for o in durable.list(holder) if "/state/" in o.key]
        assert copied == []


def forge(fast: str, step: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``step``'s manifest with ``edit`` and re-sign its marker (a forger's work, or
    a hand-edit with the digest fixed)."""
    marker_path = Path(fast, str(step), "COMMITTED")
    marker = json.loads(marker_path.read_text())
    manifest_path = Path(fast, str(step), marker["attempt"], "manifest.json")
    doc = json.loads(manifest_path.read_text())
    edit(doc)
    data = json.dumps(doc).encode()
    manifest_path.write_bytes(data)
    marker["manifest_digest"] = "sha256:" + hashlib.sha256(data).hexdigest()
    marker_path.write_text(json.dumps(marker))


def attempt_of(fast: str, step: int) -> dict[str, Any]:
    marker = json.loads(Path(fast, str(step), "COMMITTED").read_text())
    return {"step": step, "attempt": marker["attempt"]}


async def test_reference_cycles_are_typed_errors_not_recursion(tiered: ckptstore.Tiered) -> None:
    """A step naming itself as its base or referencing its own attempt is refused by every
    reader; a base cycle between two steps (1 -> 2 -> 1) fails promotion typed, at once."""
    fast = str(tiered.fast)
    await ckptstore.save(fast, lora(1), step=1)
    await ckptstore.save(fast, lora(2), step=2, base=1)
    await ckptstore.save(fast, lora(3), step=3, base=1)
    await ckptstore.save(fast, lora(4), step=4, base=1)

    def base_is(ref: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
        def edit(doc: dict[str, Any]) -> None:
            doc["base"] = ref

        return edit

    forge(fast, 3, base_is(attempt_of(fast, 3)))
    forge(fast, 4, lambda doc: doc["references"].append(attempt_of(fast, 4)))
    for step in (3, 4):
        with pytest.raises(ckptstore.CorruptCheckpointError, match="reference cycle"):
            await ckptstore.restore(fast, step=step)
        with pytest.raises(ckptstore.CorruptCheckpointError, match="reference cycle"):
            await ckptstore.promote(tiered, step=step)
        assert not (await ckptstore.verify(fast, step=step)).ok

    def cycle(doc: dict[str, Any]) -> None:  # 1 -> 2 -> 1, by base and by reference
        doc["base"] = attempt_of(fast, 2)
        doc["references"].append(attempt_of(fast, 2))

    forge(fast, 1, cycle)
    start = time.monotonic()
    with pytest.raises(ckptstore.CorruptCheckpointError, match="reference cycle"):
        await ckptstore.promote(tiered, step=2)
    assert time.monotonic() - start < 60  # not minutes of recursion
    assert await ckptstore.list_steps(tiered.durable) == []
