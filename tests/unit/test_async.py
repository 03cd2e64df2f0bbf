"""Async mode of a stage's compute: a local update per microbatch, gradients at the stashed weights of
their forward (and how stale they were), averaging rounds that leave every replica the same anchor."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tests.unit.test_runtime import OPTIM, assert_within, flat, hidden, over_the_wire, tiny_cfg

from swarm.config import OptimConfig
from swarm.model import load_stages
from swarm.server.gradvec import gradient_vector
from swarm.server.runtime import StageRuntime

ASYNC = dataclasses.replace(OPTIM, mode="async")
NAG = dataclasses.replace(ASYNC, optimizer="nag", lr=1e-3, nag_momentum=0.9)


def middle_stage() -> torch.nn.Module:
    return load_stages(tiny_cfg())[1]


def runtime(stage: torch.nn.Module, optim: OptimConfig = ASYNC) -> StageRuntime:
    return StageRuntime(copy.deepcopy(stage), optim)


def param_grads(stage: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter and input gradients of one backward through `stage` as it is (plain torch)."""
    stage = copy.deepcopy(stage)
    x = x.clone().requires_grad_(True)
    stage(x).backward(grad_out)
    return torch.cat([p.grad.reshape(-1) for p in stage.parameters()]), x.grad


def adamw_step(stage: torch.nn.Module, mean_grad: torch.Tensor, lr: float) -> torch.Tensor:
    """The parameters after one AdamW step from `stage`'s weights on `mean_grad` (plain torch)."""
    params = [p.detach().clone().requires_grad_(True) for p in stage.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=OPTIM.betas, weight_decay=OPTIM.weight_decay)
    offset = 0
    for p in params:
        p.grad = mean_grad[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    opt.step()
    return flat(params)


def test_each_microbatch_is_a_local_adamw_update_on_its_mean_gradient() -> None:
    stage = middle_stage()
    rt = runtime(stage)
    x, dy = hidden(3, seed=1), hidden(3, seed=2)
    grads, _ = param_grads(stage, x, dy)

    rt.backward("mb", x, dy)

    lr = OPTIM.lr / OPTIM.warmup_steps  # epoch 0 of the warm-up
    assert_within(flat(rt.params), adamw_step(stage, grads / 3, lr), 1e-6)
    assert rt.version == 1 and rt.epoch == 0
    assert rt.pending == {"mb": 3} and rt.pending_samples == 3  # held until the stage averages it
    assert not gradient_vector(rt.params).any()  # nothing waits in p.grad for a step
    assert rt.staleness.counts == {0: 1}


def test_a_late_backward_is_the_gradient_at_the_weights_its_forward_saw() -> None:
    """Forward A, then B's backward updates the weights; A's backward is still the exact gradient at
    the weights A's forward ran at (one update old), applied to the current weights."""
    stage = middle_stage()
    rt, twin = runtime(stage), runtime(stage)
    xa, dya = hidden(2, seed=3), hidden(2, seed=4)
    rt.forward([("A", xa)])
    for r in (rt, twin):
        r.backward("B", hidden(2, seed=5), hidden(2, seed=6))
    old_grads, old_grad_in = param_grads(stage, xa, dya)
    new_grads, _ = param_grads(twin.module, xa, dya)
    assert (new_grads - old_grads).abs().max() > 1e-4  # at the new weights it would differ

    grad_in = rt.backward("A", xa, dya)

    # the twin applies the old-weights gradient by hand, as a sum over A's two samples
    offset = 0
    for p in twin.params:
        p.grad = old_grads[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    twin._local_update(2)
    assert (rt.fast_backwards, rt.recomputed_backwards) == (1, 1)
    assert_within(grad_in, old_grad_in, 1e-6)
    assert_within(flat(rt.params), flat(twin.params), 1e-6)
    assert rt.staleness.counts == {0: 1, 1: 1}


def two_replicas(optim: OptimConfig = ASYNC) -> tuple[StageRuntime, StageRuntime]:
    stage = middle_stage()
    return runtime(stage, optim), runtime(stage, optim)


def reduce(*rounds) -> torch.Tensor:
    """What the all-reduce hands every member: the sample-weighted mean of the members' progress."""
    return sum(r.contribution for r in rounds) / sum(r.samples for r in rounds)


@pytest.mark.parametrize("optim", [ASYNC, NAG], ids=["adamw", "nag"])
def test_an_averaging_round_leaves_every_replica_the_same_anchor(optim: OptimConfig) -> None:
    a, b = two_replicas(optim)
    anchor = a.averaging.flat.clone()
    a.backward("a1", hidden(2, seed=10), hidden(2, seed=11))
    a.backward("a2", hidden(2, seed=12), hidden(2, seed=13))
    b.backward("b1", hidden(4, seed=14), hidden(4, seed=15))
    own_a, own_b = a.begin_average(), b.begin_average()
    assert (own_a.samples, own_b.samples) == (4, 4)
    b.backward("b2", hidden(2, seed=16), hidden(2, seed=17))  # b learns on while the round runs
    late = b.averaging.current() - own_b.snapshot

    mean = reduce(own_a, own_b)
    rec_a = a.finish_average(own_a, mean, 8, 2, ["a1", "a2", "b1"])
    rec_b = b.finish_average(own_b, mean, 8, 2, ["a1", "a2", "b1"])

    expected = anchor + ((own_a.snapshot - anchor) * 4 + (own_b.snapshot - anchor) * 4) / 8
    assert_within(a.averaging.flat, expected, 1e-6)
    assert torch.equal(a.averaging.flat, b.averaging.flat) and rec_a.digest == rec_b.digest == a.digest() == b.digest()
    assert torch.equal(a.averaging.current(), a.averaging.flat) and rec_a.drift == 0.0  # a did nothing meanwhile
    assert_within(b.averaging.current() - b.averaging.flat, late, 1e-6)  # b keeps what it learned meanwhile
    assert rec_b.drift == pytest.approx(float(late.norm() / b.averaging.flat.norm()), rel=1e-4) and rec_b.drift > 0
    assert a.epoch == b.epoch == 1
    assert b.pending == {"b2": 2} and b.pending_samples == 2 and not a.pending  # b2 waits for the next round
    assert set(a.committed) == set(b.committed) == {"a1", "a2", "b1"}


def test_nag_averages_its_base_weights_too() -> None:
    a, b = two_replicas(NAG)
    a.backward("a1", hidden(2, seed=20), hidden(2, seed=21))
    b.backward("b1", hidden(2, seed=22), hidden(2, seed=23))
    own_a, own_b = a.begin_average(), b.begin_average()
    assert own_a.snapshot.numel() == 2 * sum(p.numel() for p in a.params)
    mean = reduce(own_a, own_b)
    a.finish_average(own_a, mean, 4, 2, ["a1", "b1"])
    b.finish_average(own_b, mean, 4, 2, ["a1", "b1"])
    bases = [torch.cat([opt.state[p]["base"].reshape(-1) for p in rt.params]) for rt, opt in
             ((a, a.optimizer), (b, b.optimizer))]
    assert torch.equal(*bases)
    assert torch.equal(flat(a.params), flat(b.params))


def test_dropping_unaveraged_work_returns_to_the_anchor() -> None:
    """A replica taken for gone drops its pending microbatches (trainers send them again): their
    updates must leave its weights too, or they would count twice."""
    rt = runtime(middle_stage())
    anchor = rt.averaging.flat.clone()
    rt.backward("mb", hidden(2, seed=30), hidden(2, seed=31))
    assert not torch.equal(rt.averaging.current(), anchor)
    assert rt.discard_gradients() == 2
    assert torch.equal(rt.averaging.current(), anchor) and rt.pending_samples == 0


def test_a_newcomer_takes_the_anchor_not_the_sender_s_local_progress() -> None:
    a, b = two_replicas()
    a.backward("a1", hidden(2, seed=40), hidden(2, seed=41))
    own = a.begin_average()
    a.finish_average(own, reduce(own), 2, 1, ["a1"])
    a.backward("a2", hidden(2, seed=42), hidden(2, seed=43))  # not averaged yet: a's own

    b.load_state(*over_the_wire(*a.state()))

    assert torch.equal(b.averaging.current(), a.averaging.flat) and torch.equal(b.averaging.flat, a.averaging.flat)
    assert b.digest() == a.digest() and b.epoch == 1
    assert not torch.equal(flat(a.params), flat(b.params))
    assert set(b.committed) == {"a1"} and not b.pending
