"""A stage's state as it travels (to a newcomer, to a replica catching up) and goes to disk: its
parameters, buffers and optimizer state flattened into a list of tensors with a small description, and
restored from one, checked in full first (a parameter checksum, counts and shapes).
"""

from __future__ import annotations

import hashlib
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from swarm.server.runtime import StageRuntime


class Lender:
    """Tensors lent to a reader outside the compute thread (a checkpoint writer, a download served),
    remembered until the reader drops them: the runtime then need not copy its own before it next
    changes them in place (`StageRuntime.unshare`)."""

    def __init__(self) -> None:
        self._lent: list[weakref.ref] = []

    def lend(self, tensor: torch.Tensor) -> torch.Tensor:
        lent = tensor.detach().cpu()
        self._lent.append(weakref.ref(lent))
        return lent

    def held(self) -> bool:
        """Whether a reader still holds a lent tensor; lending starts afresh either way."""
        held = any(ref() is not None for ref in self._lent)
        self._lent = []
        return held


def export_state(rt: StageRuntime) -> tuple[dict, list[torch.Tensor]]:
    """Parameters, buffers and optimizer state, flattened for the wire. Async, the averaged tensors
    are sent as the anchor holds them: a replica's un-averaged progress stays its own (its pending
    microbatches would otherwise count twice in the next round).

    The parameters and optimizer state are lent, not copied: a copy would cost as much memory again
    as the stage's weights and optimizer state, on every checkpoint and every download served. They
    stay as they are while the reader holds them: the runtime moves its own to fresh memory before
    it next changes them in place, if by then a reader still holds them (`StageRuntime.unshare`). Buffers, which
    a forward may change in place (running statistics), are copied."""
    agreed = dict(zip(map(id, rt.averaged_tensors()), rt.averaging.views(), strict=True)) if rt.asynchronous else {}
    names, tensors = [], []
    for name, t in rt.module.state_dict(keep_vars=True).items():
        names.append(name)
        value = agreed.get(id(t), t)
        tensors.append(rt.lent.lend(value) if isinstance(t, torch.nn.Parameter) else value.detach().cpu().clone())
    opt_keys = []
    for index, st in sorted(rt.optimizer.state_dict()["state"].items()):
        for key, value in sorted(st.items()):
            opt_keys.append([index, key])
            tensors.append(rt.lent.lend(torch.as_tensor(agreed.get(id(value), value))))
    ledger = [[epoch, ids] for epoch, ids in rt.ledger().items()]
    meta = {"epoch": rt.epoch, "names": names, "opt_keys": opt_keys, "ledger": ledger, "digest": rt.last_digest}
    return meta, tensors


def import_state(rt: StageRuntime, meta: dict, tensors: list[torch.Tensor]) -> None:
    names, opt_keys = meta["names"], meta["opt_keys"]
    if len(tensors) != len(names) + len(opt_keys):
        raise ValueError(f"state has {len(tensors)} tensors, expected {len(names) + len(opt_keys)}")
    if "digest" in meta:  # the parameters' checksum, checked before anything is loaded
        sent = dict(zip(names, tensors, strict=False))
        trainable = [sent.get(n) for n, p in rt.module.named_parameters() if p.requires_grad]
        if any(t is None for t in trainable) or digest(trainable) != meta["digest"]:
            raise ValueError(f"state checksum mismatch: expected {meta['digest']}")
    rt.unshare()
    rt.module.load_state_dict(dict(zip(names, tensors[: len(names)], strict=True)))
    opt_state = rt.optimizer.state_dict()
    opt_state["state"] = {}
    for (index, key), t in zip(opt_keys, tensors[len(names) :], strict=True):
        opt_state["state"].setdefault(index, {})[key] = t
    rt.optimizer.load_state_dict(opt_state)
    rt.epoch = int(meta["epoch"])
    if rt.asynchronous:
        rt.averaging.retake()
    rt.version += 1
    rt.last_digest = rt.digest()
    rt.discard_gradients()
    rt.book.restore(meta.get("ledger", []))


def digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())  # the bytes in place, not a copy
    return h.hexdigest()[:16]
