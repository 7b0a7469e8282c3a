"""`make outage`'s campaign, short: saves go on through an outage and the durable tier
catches up (the 60 s runs are in docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.campaigns import outage


def test_a_short_outage_run_keeps_saving_and_catches_up(tmp_path: Path) -> None:
    out = tmp_path / "outage.json"
    argv = ["--outage", "2", "--before", "1", "--after", "4", "--every", "0.5", "--out", str(out)]
    assert outage.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["saves_during_outage"] >= 1 and result["problems"] == []
    assert result["caught_up_seconds_after_outage"] is not None
    assert result["most_unpromoted"] >= 1  # the outage was felt
