"""Nesterov accelerated gradient as a weight correction (Zuo et al., 2025, eq. 2).

    d_t     = gamma * (w_t - w_{t-1})
    w_{t+1} = w_t + d_t - lr * grad f(w_t + d_t)

The parameters a stage serves hold the look-ahead point `w_t + d_t`, so the gradients its forward and
backward passes produce are taken there, as the update wants; the optimizer keeps `w_t` (state
`base`) to form the next correction. A gradient that arrives computed at older weights (a stale one,
from a microbatch that was in flight across a step) is applied by the same rule: the look-ahead
anticipates where the weights are heading, which is what makes the correction absorb staleness.
Weight decay, if any, is decoupled (it shrinks `w_t`, as AdamW does).

With `rms_beta` set, each gradient coordinate is first divided by the root of its running mean
square (Adam's second moment, bias-corrected), and the rule above is applied to that. A plain gradient
step is on the scale of the gradients, which differ by orders of magnitude between a transformer's
embeddings, norms and projections, so no single `lr` suits them all; the normalized step is on
Adam's per-coordinate scale (about `lr / (1 - gamma)` per coordinate once the velocity has built up),
where the usual learning rates of language models apply. The weight correction itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from swarm.config import OptimConfig


class NesterovCorrection(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.99,
                 weight_decay: float = 0.0, rms_beta: float | None = None, eps: float = 1e-8):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or not (rms_beta is None or 0 <= rms_beta < 1):
            raise ValueError(f"bad NAG settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                             f"rms_beta={rms_beta}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "rms_beta": rms_beta, "eps": eps})
        for group in self.param_groups:  # w_0, before any step: d_0 = 0, so the parameter is w_0 itself
            for p in group["params"]:
                self.state[p]["base"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001  torch's signature
        for group in self.param_groups:
            lr, gamma, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = p.grad.to(p.dtype)
                if group["rms_beta"] is not None:
                    grad = self._normalized(state, grad, group["rms_beta"], group["eps"])
                base = state["base"]
                new = p - lr * grad  # w_{t+1} = (w_t + d_t) - lr * grad
                if decay:
                    new -= lr * decay * base
                correction = gamma * (new - base)  # d_{t+1}
                base.copy_(new)
                p.copy_(new + correction)

    @staticmethod
    def _normalized(state: dict, grad: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
        """`grad / (sqrt(bias-corrected running mean of grad^2) + eps)`, updating that mean."""
        if "square" not in state:
            state["square"] = torch.zeros_like(grad)
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        state["square"].mul_(beta).addcmul_(grad, grad, value=1 - beta)
        mean_square = state["square"] / (1 - beta ** float(state["step"]))
        return grad / (mean_square.sqrt() + eps)


def stage_optimizer(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer `optim.optimizer` names: AdamW, or this module's weight correction (async mode)."""
    if optim.optimizer == "nag":
        rms_beta = optim.betas[1] if optim.nag_normalize else None
        return NesterovCorrection(params, lr=optim.base_lr, momentum=optim.nag_momentum,
                                  weight_decay=optim.weight_decay, rms_beta=rms_beta)
    return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                             fused=fusable(params))


def fusable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters: one pass over each, where the default (one
    parameter at a time on a CPU) makes a dozen: a quarter of the CPU time for a stage of the benchmark model
    (`benchmarks/step_cost.py`). Every replica runs the same kernel, so replicas stay bit-identical."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
