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


def test_the_made_up_microbatch_is_counted_by_the_compute_gate_as_served_work_is() -> None:
    """Through the gate, as any job: a server slowed (or held to a CPU share) is slowed there too, and
    each pass is counted with the microbatch's samples by the gate's own accounting."""
    counted: list[tuple[str, int]] = []

    async def scenario() -> None:
        gate = ComputeGate(3.0, True)
        _, st = served(0, gate)
        gate.count_work = lambda work, samples, seconds, alone: counted.append((work, samples))
        await calibrate(st, gate, 4, CFG.model.vocab_size)

    asyncio.run(scenario())
    assert counted == [("forward", 4), ("backward", 4)]
