"""Back-propagation through a stage, and fp16's loss scale: what lets a GPU without bf16 (Volta, Turing:
V100, T4, the cards volunteers and preemptible clouds have most of) train at its fp16 rate.

fp16 holds values up to 65504, and gradients below about 6e-8 vanish in it. A replica computing in fp16
scales the gradient each backward starts from so that its largest value is about its loss scale S (the loss
itself: times S), and divides what comes out (its parameters' and its inputs' gradients, in fp32) by the same
factor before it keeps or sends any of it. The scale never leaves the replica: the trainer, the other stages
and the stage's other replicas get and send gradients at their true size. So each replica keeps a scale of
its own, replicas on fp16, bf16 and fp32 serve one stage together, a newcomer starts at the initial scale,
and the stage's agreed state holds none.

Scaling each incoming gradient to S by its own largest value (a power of two, so exactly) makes S track the
stage's own gain, how much larger than its incoming gradient a backward's values grow, and not the size of
what a caller sends: a gradient a thousand times larger, honest or not, runs at the same scale and costs no
retry (a request's gradient norm is bounded, `server.max_grad_norm`, but far above an honest one's).

A backward whose gradients overflowed (an inf or NaN among them, its forward finite) runs again through the
same graph at half the scale before any of it is kept. torch's GradScaler skips the whole optimizer step
instead; here that would drop the other replicas' work on the microbatch, or, decided by one replica alone,
split the stage's replicas. Nothing is lost or skipped: an overflow costs one more backward. After
`growth_interval` clean backwards in a row the scale doubles, to keep small gradients above fp16's floor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("swarm.server")
MIN_SCALE = 2.0**-24  # below it, halving cannot bring a gradient into fp16's range: the overflow is kept


@dataclass
class LossScale:
    """One replica's dynamic loss scale (powers of two, so scaling and unscaling are exact)."""

    scale: float = 2.0**15  # (an incoming gradient's largest value scaled to 2**16 would be inf in fp16)
    growth_interval: int = 2000  # clean backwards in a row before the scale doubles
    clean: int = 0
    overflows: int = 0  # backwards run again at a smaller scale

    def overflowed(self) -> bool:
        """One backward overflowed: halve the scale. False where it is at its floor (keep the result)."""
        if self.scale <= MIN_SCALE:
            return False
        self.overflows += 1
        self.clean = 0
        log.info("fp16 gradients overflowed at loss scale %g: the backward runs again at %g", self.scale,
                 self.scale / 2)
        self.scale /= 2
        return True

    def cleared(self) -> None:
        """One backward kept without overflow."""
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale *= 2
            self.clean = 0

    def grads(self, root: torch.Tensor, grad: torch.Tensor | None,
              wrt: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradients of `root` (`grad` back-propagated from it; None: `root` is the scalar loss) with
        respect to `wrt`, at their true size; None for a tensor the graph does not reach."""
        if grad is not None:
            grad = grad.to(root.device, torch.float32)
            top = grad.abs().amax()
            # a power of two above the gradient's largest value, read off its exponent (1 for a zero gradient)
            unit = torch.ldexp(torch.ones_like(top), torch.frexp(top).exponent)
        while True:
            factor = torch.full((), self.scale, device=root.device) / (1 if grad is None else unit)
            scaled_root = root * factor if grad is None else root
            seeds = None if grad is None else (grad * factor).to(root.dtype)
            grads = torch.autograd.grad(scaled_root, wrt, seeds, retain_graph=True, allow_unused=True)
            present = [g for g in grads if g is not None]
            found = torch.zeros(1, device=root.device)
            if present:
                torch._amp_foreach_non_finite_check_and_unscale_(present, found, (1 / factor).reshape(1))
            if not found.item():
                self.cleared()
                return list(grads)
            finite = bool(torch.isfinite(root).all()) and (grad is None or bool(torch.isfinite(top)))
            if not (finite and self.overflowed()):
                return list(grads)  # as an fp32 backward of a non-finite input: the step's norm check skips it


def backprop(scale: LossScale | None, root: torch.Tensor, grad: torch.Tensor | None, inputs: torch.Tensor,
             leaves: list[torch.Tensor]) -> torch.Tensor | None:
    """Back-propagate from `root` (`grad` its gradient; None: `root` is the scalar loss): the gradients of
    `leaves` added to their `.grad`, and the gradient of `inputs` returned (None where it takes none).
    Without a scale, autograd's own accumulation, as every fp32 and bf16 stage runs it."""
    wants_input = inputs.requires_grad
    if not (leaves or wants_input):
        return None
    if scale is None:
        seeds = None if grad is None else grad.to(root.device, root.dtype)
        if leaves:
            root.backward(seeds)
            return inputs.grad if wants_input else None
        return torch.autograd.grad(root, inputs, seeds)[0]
    grads = scale.grads(root, grad, [*leaves, *([inputs] if wants_input else [])])
    for leaf, g in zip(leaves, grads, strict=False):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad.add_(g)
    return grads[-1] if wants_input else None
