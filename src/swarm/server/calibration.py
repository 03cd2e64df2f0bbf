"""The rate a server announces before any trainer has used it: one made-up microbatch, timed.

A server's announced throughput steers the trainers' routing (`swarm.core.routing`). Until it has
served work of both passes it announced none, and trainers took it for a typical server of its stage:
in a swarm that starts together, every server got an equal share of the first calls, and a server three
times slower than its peers held calls in its queue until they timed out (60 s, minutes into the run).
One forward and one backward of a microbatch of the trainers' size, through the compute gate like any
job (a slowed server is slowed here too), give a first figure; the served work replaces it within a few
announcement periods.
"""

from __future__ import annotations

import logging

import torch

from swarm.server.gate import ComputeGate
from swarm.server.runtime import StageRuntime
from swarm.server.stage import ServedStage

log = logging.getLogger("swarm.server")


def made_up_batch(st: ServedStage, samples: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inputs of the stage's kind (token ids or hidden states), and targets for the last stage."""
    spec, shape = st.in_spec, (samples, *st.in_spec.sample_shape)
    if spec.dtype.is_floating_point:
        x = torch.randn(shape, dtype=spec.dtype)
    else:
        x = torch.randint(0, spec.max_value or vocab_size, shape, dtype=spec.dtype)
    targets = torch.randint(0, vocab_size, shape[:2]) if st.runtime.is_last else None
    return x, targets


def trial_forward(rt: StageRuntime, x: torch.Tensor, targets: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward pass, and for the last stage its backward too (as its calls run both): (inputs, outputs)."""
    inputs = rt.leaf(x)
    with rt.autocast():
        out = rt.module(inputs, *([] if targets is None else [targets.to(rt.device)]))
    if targets is not None:
        trial_backward(rt, inputs, out)
    _finish(rt)
    return inputs, out


def trial_backward(rt: StageRuntime, inputs: torch.Tensor, out: torch.Tensor) -> None:
    """The backward of `trial_forward`, leaving nothing behind: `torch.autograd.grad` returns the
    parameters' gradients instead of accumulating them, and no graph or ledger entry is kept."""
    wrt = [p for p in rt.params if p.requires_grad] + ([] if rt.is_first else [inputs])
    if wrt:
        torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)
    _finish(rt)


def _finish(rt: StageRuntime) -> None:
    if rt.device.type == "cuda":  # kernels run asynchronously: the time is the device's
        torch.cuda.synchronize(rt.device)


async def calibrate(st: ServedStage, gate: ComputeGate, samples: int, vocab_size: int) -> float:
    """Time one made-up microbatch of `samples` and fold it into the stage's rate; the rate."""
    x, targets = made_up_batch(st, samples, vocab_size)
    # on a GPU the first passes pay one-off costs (kernels chosen, handles made): they go uncounted
    for counted in (False, True) if st.runtime.device.type == "cuda" else (True,):
        inputs, out = await gate.run(trial_forward, st.runtime, x, targets, work="forward" if counted else None,
                                     samples=samples)
        if targets is None:
            await gate.run(trial_backward, st.runtime, inputs, out, work="backward" if counted else None,
                           samples=samples)
    st.work.fold(0.0)
    rate = st.work.meter.rate
    log.info("stage %d server %s: %.2f samples/s on a made-up microbatch of %d, until served work says more",
             st.index, st.label, rate, samples)
    return rate
