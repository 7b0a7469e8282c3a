"""The durable tier going away and coming back at every point of a promotion, a
`delete_step` and a `gc` on tiers (pairs with up to two preemptions: the outage can begin
and end anywhere), and random walks of the triples (`interleave_outage.py`)."""

from __future__ import annotations

from tests.campaigns import interleave
from tests.campaigns.interleave_outage import OUTAGE, OUTAGE_TRIPLES


async def test_an_outage_anywhere_in_promotion_delete_and_gc_loses_nothing() -> None:
    tally = interleave.Tally()
    for scenario in OUTAGE:
        await interleave.explore_pairs(scenario, bound=2, tally=tally)
    for k, scenario in enumerate(OUTAGE_TRIPLES):
        await interleave.random_walks(scenario, walks=10, seed=3000 * k, tally=tally)
    failing = [f"{r.scenario}: {r.problems} (schedule {r.schedule})" for r in tally.examples]
    assert tally.failing == 0, "\n".join(failing)
    assert all(tally.per_scenario[s.name][0] >= 1 for s in OUTAGE + OUTAGE_TRIPLES)
    assert tally.schedules > 150
