"""Nesterov weight correction, step by step on f(w) = a w^2 / 2 (gradient a w), against values worked
out by hand from d_t = gamma (w_t - w_{t-1}), w_{t+1} = w_t + d_t - lr grad f(w_t + d_t)."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.server.nag import NesterovCorrection

A, LR, GAMMA = 2.0, 0.1, 0.5


def _optimizer(w0: float = 1.0) -> tuple[torch.nn.Parameter, NesterovCorrection]:
    p = torch.nn.Parameter(torch.tensor([w0], dtype=torch.float64))
    return p, NesterovCorrection([p], lr=LR, momentum=GAMMA)


def _step(p: torch.nn.Parameter, opt: NesterovCorrection, at: float | None = None) -> None:
    """One step with the gradient taken at the served (look-ahead) point, or at `at` (a stale one)."""
    p.grad = torch.tensor([A * (p.item() if at is None else at)], dtype=torch.float64)
    opt.step()


def test_each_step_follows_the_formula() -> None:
    # w0 = 1, d0 = 0: served 1.0, grad 2.0  -> w1 = 1 - 0.2 = 0.8,   d1 = 0.5 (0.8 - 1)   = -0.1,  served 0.7
    # served 0.7, grad 1.4                   -> w2 = 0.7 - 0.14 = 0.56, d2 = 0.5 (0.56 - 0.8) = -0.12, served 0.44
    # served 0.44, grad 0.88                 -> w3 = 0.44 - 0.088 = 0.352, d3 = 0.5 (0.352 - 0.56) = -0.104,
    #                                           served 0.248
    p, opt = _optimizer()
    expected = [(0.8, 0.7), (0.56, 0.44), (0.352, 0.248)]
    for w, served in expected:
        _step(p, opt)
        assert opt.state[p]["base"].item() == pytest.approx(w, abs=1e-12)
        assert p.item() == pytest.approx(served, abs=1e-12)


def test_a_stale_gradient_is_applied_at_the_look_ahead_point() -> None:
    # as above for two steps (served 0.44 after them); the third gradient was computed at the point
    # served one step earlier (0.7): grad 1.4 -> w3 = 0.44 - 0.14 = 0.30, d3 = 0.5 (0.30 - 0.56) = -0.13,
    # served 0.17
    p, opt = _optimizer()
    _step(p, opt)
    _step(p, opt)
    _step(p, opt, at=0.7)
    assert opt.state[p]["base"].item() == pytest.approx(0.30, abs=1e-12)
    assert p.item() == pytest.approx(0.17, abs=1e-12)


def test_without_momentum_it_is_plain_gradient_descent() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = NesterovCorrection([p], lr=LR, momentum=0.0)
    for _ in range(3):
        _step(p, opt)
    assert p.item() == pytest.approx((1 - LR * A) ** 3, abs=1e-12)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="momentum"):
        NesterovCorrection([torch.nn.Parameter(torch.ones(1))], lr=0.1, momentum=1.0)


def test_normalized_steps_follow_the_formula_on_the_rms_scaled_gradient() -> None:
    # rms_beta 0.5, eps 0. Step 1: served 1.0, grad 2.0, mean square (0.5 * 4) / (1 - 0.5) = 4 -> scaled
    # grad 1 -> w1 = 1 - 0.1 = 0.9, d1 = 0.5 (0.9 - 1) = -0.05, served 0.85.
    # Step 2: grad 1.7, running square 0.5 * 2 + 0.5 * 2.89 = 2.445, bias-corrected / (1 - 0.25) = 3.26
    # -> scaled grad 1.7 / sqrt(3.26) -> w2 = 0.85 - 0.1 * that, served w2 + 0.5 (w2 - 0.9)
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = NesterovCorrection([p], lr=LR, momentum=GAMMA, rms_beta=0.5, eps=0.0)
    _step(p, opt)
    assert opt.state[p]["base"].item() == pytest.approx(0.9, abs=1e-12)
    assert p.item() == pytest.approx(0.85, abs=1e-12)
    _step(p, opt)
    w2 = 0.85 - LR * 1.7 / math.sqrt(3.26)
    assert opt.state[p]["base"].item() == pytest.approx(w2, abs=1e-12)
    assert p.item() == pytest.approx(w2 + GAMMA * (w2 - 0.9), abs=1e-12)


def test_normalized_steps_do_not_depend_on_the_scale_of_the_gradients() -> None:
    # two coordinates on curvatures 1000x apart move by the same steps when both start at 1: the
    # normalization is what lets one lr suit a model's differently scaled weights
    small, large = (torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64)) for _ in range(2))
    opt = NesterovCorrection([small, large], lr=0.01, momentum=0.9, rms_beta=0.95, eps=0.0)
    for _ in range(5):
        small.grad = 0.001 * small.detach().clone()
        large.grad = 1.0 * large.detach().clone()
        opt.step()
        assert small.item() == pytest.approx(large.item(), abs=1e-12)
    assert small.item() < 0.9  # and they did move
