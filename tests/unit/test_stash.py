"""Weights kept for overtaken graphs: a backward after any number of in-place changes is the exact
gradient at the weights its forward ran at, and a copy lives only while a graph needs it."""

from __future__ import annotations

import torch

from swarm.server.stash import KeptWeights


def module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def test_a_backward_two_changes_later_is_the_gradient_at_its_forwards_weights() -> None:
    live, reference = module(), module()
    params = list(live.parameters())
    version = [0]
    kept = KeptWeights(params, lambda: version[0])
    x = torch.randn(3, 8, requires_grad=True)
    with kept.saving():
        out = live(x)
    for _ in range(2):  # two steps; only the first changes weights the graph still needs
        kept.keep()
        with torch.no_grad():
            for p in params:
                p.mul_(1.5).add_(0.1)
        version[0] += 1
    assert kept.holds(0) and kept.holds(1)
    kept.release([0])
    assert kept.holds(0) and not kept.holds(1)

    dy = torch.randn(3, 4)
    out.backward(dy)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, reference.parameters(), strict=True))
    kept.release([])
    assert not kept.holds(0)



def test_a_step_copies_only_the_weights_graphs_saved() -> None:
    """Under autocast a matmul saves its own half-precision cast of the weight, which the step leaves as it
    was: only the parameters saved as they are (the LayerNorm's here) are copied, and the backward is still
    the gradient at its forward's weights."""
    live, reference = module(), module()
    params = list(live.parameters())
    version = [0]
    kept = KeptWeights(params, lambda: version[0])
    x = torch.randn(3, 8)
    with kept.saving(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = live(x)
    kept.keep()
    with torch.no_grad():
        for p in params:
            p.mul_(1.5).add_(0.1)
    version[0] += 1
    norm = {id(p) for p in live[2].parameters()}
    assert [copy is not None for copy in kept._kept[0]] == [id(p) in norm for p in params]

    dy = torch.randn(3, 4).bfloat16()
    out.backward(dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(x).backward(dy)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, reference.parameters(), strict=True))
