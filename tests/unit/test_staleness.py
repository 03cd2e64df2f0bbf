"""Staleness in sync mode is counted where the step takes a gradient in: one step late for a backward that a
step overtook, two for one whose backward came while the round of the step after was already summing."""

from __future__ import annotations

from tests.unit.test_runtime import hidden, runtime, tiny_cfg

from swarm.model import load_stages
from swarm.server.gradvec import gradient_vector


def test_a_sync_gradient_counts_the_steps_between_its_forward_and_the_step_that_takes_it():
    rt = runtime(load_stages(tiny_cfg())[1])
    rt.forward([("A", hidden(2, seed=1))])  # at the weights of version 0; its backward comes late

    def round_step():
        part = rt.begin_step()  # what the round sums; backwards from here on wait for the next step
        return lambda: rt.apply_step(part.flat / part.samples, part.samples, group=1, own=part)

    rt.forward([("B", hidden(2, seed=2))])
    rt.backward("B", hidden(2, seed=2), hidden(2, seed=3))
    round_step()()  # step 1 takes B, whose forward ran at the weights it steps: 0 late
    rt.forward([("C", hidden(2, seed=4))])
    rt.backward("C", hidden(2, seed=4), hidden(2, seed=5))
    finish = round_step()  # step 2's round takes C ...
    rt.backward("A", hidden(2, seed=1), hidden(2, seed=6))  # ... and A's backward comes while it runs
    finish()
    assert rt.staleness.counts == {0: 2}  # A is held, not yet applied
    assert (rt.fast_backwards, rt.recomputed_backwards) == (3, 0)  # every backward ran through its kept graph

    rt.apply_step(gradient_vector(rt.params) / 2, 2, group=1)  # step 3 takes A: forward at 0, applied at 2
    assert rt.staleness.counts == {0: 2, 2: 1}
    assert rt.pending == {}
