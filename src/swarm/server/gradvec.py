"""The stage's accumulated gradients as one vector: what an all-reduce round sends and averages."""

from __future__ import annotations

import torch


def gradient_vector(params: list[torch.Tensor]) -> torch.Tensor:
    """All accumulated gradients as one float32 vector on the CPU (zeros where none arrived yet).

    On a CPU stage of float32 parameters the gradients move into the vector: each `p.grad` becomes
    a view of it, so the round costs no second copy of the stage's gradients, and a round that fails
    leaves them in place for the next (backwards in between add to them there)."""
    if not all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        return torch.cat([g.detach().float().reshape(-1).cpu() for g in grads])
    flat = _existing_vector(params)
    if flat is None:
        flat = torch.empty(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            view = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view  # the old gradient is freed here: at most one tensor is held twice
            offset += p.numel()
    return flat


def _existing_vector(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The vector an earlier `gradient_vector` made every gradient a view of, if they still are."""
    first = params[0].grad if params else None
    base = None if first is None else first._base
    offset = 0
    for p in params:
        if base is None or p.grad is None or p.grad._base is not base or p.grad.storage_offset() != offset:
            return None
        offset += p.numel()
    return base if base.numel() == offset else None


def take_vector(params: list[torch.Tensor]) -> torch.Tensor:
    """`gradient_vector`, taken out of the parameters: their gradients start afresh, so that backwards go
    on accumulating (for the next step) while a round all-reduces the vector."""
    flat = gradient_vector(params)
    for p in params:
        p.grad = None
    return flat


def give_back(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """What `take_vector` took, back into the gradients (its round failed), beside what came meanwhile."""
    offset = 0
    for p in params:
        part = flat[offset : offset + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype)
        if p.grad is None:
            p.grad = part
        else:
            p.grad.add_(part)
        offset += p.numel()


class SetAside:
    """The part of a replica's failed round, held apart from what accumulated after it. A retry at the same
    epoch sends that very part again (`take`), never what came since: owners that reduced it in an earlier
    attempt answer a repeat with their old result, which holds only if every member's part is the same
    from one attempt to the next. A failed round may also have succeeded elsewhere (a slow owner that got
    every part steps; the members that gave up waiting for it do not), so a replica that steps alone, or
    loads a state, does not take the part in: it goes back into the gradients once this replica has
    stepped without it (it then counts in the next step, one step old, as the gradients that come in
    during a round do), or is settled by the ledger of a state loaded one step ahead
    (`swarm.core.ledger.carry`)."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, list[str]]] = []  # (vector, microbatch ids)

    def add(self, flat: torch.Tensor, ids: list[str]) -> None:
        self.parts.append((flat, ids))

    def take(self) -> tuple[torch.Tensor, list[str]]:
        """The part held, no longer held apart. There is one at most: a retry takes it, and its failure
        returns it; a step without it, or a loaded state, settles it."""
        ((flat, ids),) = self.parts
        self.parts = []
        return flat, ids

    def ids(self) -> set[str]:
        return {req_id for _, ids in self.parts for req_id in ids}

    def outside(self, pending: dict[str, int]) -> tuple[int, list[str]]:
        """The samples and ids of the held microbatches (`pending`: id -> samples) not in a part."""
        apart = self.ids()
        ids = sorted(req_id for req_id in pending if req_id not in apart)
        return sum(pending[req_id] for req_id in ids), ids

    def give_back(self, params: list[torch.Tensor], keep: list[bool] | None = None) -> list[str]:
        """Every part back into the gradients (or those `keep` marks); the ids of the parts not given back."""
        dropped = []
        for (flat, ids), kept in zip(self.parts, keep or [True] * len(self.parts), strict=True):
            if kept:
                give_back(params, flat)
            else:
                dropped += ids
        self.parts = []
        return dropped
