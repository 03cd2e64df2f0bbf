"""fp16's loss scale: each replica's own, an overflowed backward run again at half the scale before any of
it is kept, and gradients that leave the replica at their true size (on a CPU, whose autocast has fp16)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.unit.test_runtime import OPTIM, batch, flat, hidden, tiny_cfg

from swarm.config import ConfigError, ServerConfig
from swarm.model import load_stages
from swarm.server.lossscale import MIN_SCALE, LossScale
from swarm.server.runtime import StageRuntime

TOO_LARGE = 2.0**40  # a loss of a few nats times this, cast to fp16, is inf


def grads(rt: StageRuntime) -> torch.Tensor:
    return flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in rt.params])


def close(a: torch.Tensor, b: torch.Tensor, within: float = 2e-2) -> bool:
    return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm()) < within


def fp16(stage: torch.nn.Module, scale: float) -> StageRuntime:
    return StageRuntime(copy.deepcopy(stage), OPTIM, autocast="fp16", fp16_scale=LossScale(scale))


def test_the_scale_halves_on_an_overflow_and_doubles_after_a_run_of_clean_backwards() -> None:
    s = LossScale(8.0, growth_interval=3)
    s.cleared()
    assert s.overflowed() and (s.scale, s.overflows, s.clean) == (4.0, 1, 0)
    s.cleared(), s.cleared()
    assert s.scale == 4.0
    s.cleared()
    assert (s.scale, s.clean) == (8.0, 0)
    floor = LossScale(MIN_SCALE)
    assert not floor.overflowed() and floor.scale == MIN_SCALE and floor.overflows == 0


def test_an_overflowed_backward_leaves_no_trace_and_its_gradients_match_fp32() -> None:
    """The last stage and the first (its kept graph), at a scale far too large: each backward runs again
    until it fits, and what is kept and sent is bit for bit what a backward at that final scale gives from
    the start, and within fp16's precision of fp32's."""
    first, last = load_stages(tiny_cfg(2, 2))
    inputs, targets = batch(4, seed=3)
    exact = [StageRuntime(copy.deepcopy(s), OPTIM) for s in (first, last)]
    over = [fp16(s, TOO_LARGE) for s in (first, last)]

    def run(pair: list[StageRuntime]) -> torch.Tensor:
        (h,) = pair[0].forward([("mb", inputs)])
        _, dh = pair[1].forward_backward_last("mb", h.float(), targets)
        assert pair[0].backward("mb", inputs, dh) is None and pair[0].fast_backwards == 1
        return dh

    want, got = run(exact), run(over)
    for rt in over:
        assert rt.loss_scale.overflows >= 1 and rt.loss_scale.scale < TOO_LARGE
    assert close(got, want)
    for e, o in zip(exact, over, strict=True):
        assert close(grads(o), grads(e))

    fitting = [fp16(s, o.loss_scale.scale) for s, o in zip((first, last), over, strict=True)]
    again = run(fitting)
    assert all(rt.loss_scale.overflows == 0 for rt in fitting)
    assert torch.equal(again, got)
    for f, o in zip(fitting, over, strict=True):
        assert torch.equal(grads(f), grads(o))


def test_recomputed_and_input_only_backwards_go_through_the_scale_too() -> None:
    """A middle stage's backward without a kept graph (recomputed), and one for a microbatch it already
    holds (the input's gradient alone, the parameters' left as they were)."""
    mid = load_stages(tiny_cfg(3, 3))[1]
    x, dy = hidden(2, seed=4), hidden(2, seed=5)
    exact, over = StageRuntime(copy.deepcopy(mid), OPTIM), fp16(mid, TOO_LARGE)
    want = exact.backward("mb", x, dy)
    got = over.backward("mb", x, dy)
    assert over.recomputed_backwards == 1 and over.loss_scale.overflows >= 1
    assert close(got, want) and close(grads(over), grads(exact))
    held = grads(over)
    overflows = over.loss_scale.overflows
    over.loss_scale.scale = TOO_LARGE
    again = over.backward("mb", x, dy)  # a duplicate: input gradient only
    assert over.duplicates == 1 and over.loss_scale.overflows > overflows
    assert close(again, want) and torch.equal(grads(over), held)


def test_the_size_of_an_incoming_gradient_does_not_move_the_scale() -> None:
    """A gradient 1024 times larger (as large as a request's bound lets a hostile caller make it) runs at
    the same scale, overflows no more often, and gives exactly 1024 times the gradients."""
    mid = load_stages(tiny_cfg(3, 3))[1]
    x, dy = hidden(2, seed=8), hidden(2, seed=9)
    small, large = fp16(mid, 2.0**15), fp16(mid, 2.0**15)
    a, b = small.backward("mb", x, dy), large.backward("mb", x, dy * 1024)
    assert large.loss_scale.scale == small.loss_scale.scale
    assert large.loss_scale.overflows == small.loss_scale.overflows
    assert torch.equal(b, a * 1024) and torch.equal(grads(large), grads(small) * 1024)


def test_a_non_finite_forward_is_not_retried() -> None:
    """Halving cannot mend a forward that is already inf: the backward is kept as an fp32 one would be (the
    step's norm check then skips it), and the scale stays."""
    mid = load_stages(tiny_cfg(3, 3))[1]
    rt = fp16(mid, 2.0**15)
    x = hidden(2, seed=6)
    x[0, 0, 0] = float("inf")
    rt.backward("mb", x, hidden(2, seed=7))
    assert rt.loss_scale.scale == 2.0**15 and rt.loss_scale.overflows == 0
    assert not bool(torch.isfinite(grads(rt)).all())


def test_fp32_and_bf16_stages_have_no_loss_scale() -> None:
    stage = load_stages(tiny_cfg(2, 2))[1]
    assert StageRuntime(copy.deepcopy(stage), OPTIM).loss_scale is None
    assert StageRuntime(copy.deepcopy(stage), OPTIM, autocast="bf16").loss_scale is None


@pytest.mark.parametrize("scale", [0.0, 3.0, -4.0])
def test_the_initial_scale_must_be_a_power_of_two(scale: float) -> None:
    with pytest.raises(ConfigError, match="fp16_loss_scale"):
        ServerConfig(autocast="fp16", fp16_loss_scale=scale)
    assert ServerConfig(autocast="fp16", fp16_loss_scale=2.0**-3).autocast == "fp16"
