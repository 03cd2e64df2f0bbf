"""A server's first announced rate comes from one made-up microbatch, timed through its compute gate,
and leaves the stage as it was: no gradient, graph or ledger entry."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tests.unit.test_server_parts import CFG, served

from swarm.server.calibration import calibrate
from swarm.server.gate import ComputeGate


@pytest.mark.parametrize("stage", [0, 1])
def test_a_made_up_microbatch_gives_the_first_rate_and_leaves_nothing_behind(stage: int) -> None:
    async def scenario():
        gate = ComputeGate(1.0, False)
        _, st = served(stage, gate)
        gate.count_work = st.work.count
        assert st.work.meter.rate == 0.0  # unmeasured: trainers would take it for a typical server
        weights = [p.detach().clone() for p in st.runtime.params]
        rate = await calibrate(st, gate, 4, CFG.model.vocab_size)
        return st, weights, rate

    st, weights, rate = asyncio.run(scenario())
    rt = st.runtime
    assert rate > 0 and rate == st.work.meter.rate
    assert all(p.grad is None for p in rt.params) and not rt.graphs and rt.pending_samples == 0
    assert all(torch.equal(p, w) for p, w in zip(rt.params, weights, strict=True))


def test_a_slower_server_announces_a_slower_first_rate() -> None:
    """Through the gate, as any job: a server slowed threefold announces about a third of the rate."""
    async def rate_at(slowdown: float) -> float:
        gate = ComputeGate(slowdown, True)
        _, st = served(0, gate)
        gate.count_work = st.work.count
        await calibrate(st, gate, 4, CFG.model.vocab_size)  # (the first pays one-off costs)
        st.work.meter = type(st.work.meter)(st.work.meter.passes, alpha=1.0)
        return await calibrate(st, gate, 4, CFG.model.vocab_size)

    fast, slow = asyncio.run(rate_at(1.0)), asyncio.run(rate_at(3.0))
    assert 2.0 < fast / slow < 4.5, (fast, slow)
