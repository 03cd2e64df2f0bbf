"""A stage's state as it travels (to a newcomer, to a replica catching up, to a backup holder) and goes to
disk: its parameters, buffers and optimizer state flattened into a list of tensors with a small description,
and restored from one, checked in full first (a parameter checksum, counts and shapes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from swarm.config import ModelConfig
from swarm.core.ledger import carry
from swarm.model import build_stage
from swarm.server.anchor import averaged
from swarm.server.graphs import REPLACED
from swarm.server.weights_hash import digest
from swarm.wire.validate import all_finite

if TYPE_CHECKING:
    from swarm.server.runtime import StageRuntime


class Lender:
    """Tensors lent to a reader outside the compute thread (a checkpoint writer, a download served),
    remembered until the reader drops them: the runtime then need not copy its own before it next
    changes them in place (`StageRuntime.unshare`)."""

    def __init__(self) -> None:
        self._lent: list[weakref.ref] = []

    def lend(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor on the host: itself where it lives there (remembered), else the reader's own copy."""
        lent = tensor.detach().cpu()
        if lent.data_ptr() == tensor.data_ptr():
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
    agreed = {}
    if rt.asynchronous:
        agreed = dict(zip(map(id, averaged(rt.params, rt.optimizer)), rt.averaging.views(), strict=True))
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
    ledger = [[epoch, ids] for epoch, ids in rt.book.steps().items()]
    meta = {"epoch": rt.epoch, "names": names, "opt_keys": opt_keys, "ledger": ledger, "digest": rt.last_digest}
    return meta, tensors


@dataclass(frozen=True)
class StateLayout:
    """What a stage's state holds, read off the stage's module: what `check_state` holds a state to."""

    entries: dict[str, tuple[torch.Size, torch.dtype]]  # the module's state dict, in its order
    params: tuple[torch.Size, ...]  # the trainable parameters' shapes, in the optimizer's order
    trainable: tuple[str, ...]  # their names: the parameters the digest covers

    @classmethod
    def of(cls, module: torch.nn.Module) -> StateLayout:
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        return cls({n: (t.shape, t.dtype) for n, t in module.state_dict().items()},
                   tuple(p.shape for _, p in trainable), tuple(n for n, _ in trainable))

    @classmethod
    def of_stage(cls, model: ModelConfig, index: int) -> StateLayout:
        """A stage's layout, its module built as a replica builds it but without reading pretrained weights,
        then dropped: a peer that holds copies of stages it does not serve checks them as the stage's replicas
        would. (Not on the meta device: initializing weights there imports torch's compiler, seconds of CPU
        that held a backup peer's first copy back while its stage stepped on.)"""
        return cls.of(build_stage(replace(model, hf_weights=""), index))


def check_state(layout: StateLayout, meta: dict, tensors: list[torch.Tensor]) -> None:
    """Everything a state must be before any of it is applied or kept (it comes from another peer, or from a
    disk another process wrote): a ValueError says what is wrong, and the stage is left as it was."""
    if not isinstance(meta, dict):
        raise ValueError("state description is not a map")
    names, opt_keys, epoch, ledger = (meta.get(k) for k in ("names", "opt_keys", "epoch", "ledger"))
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"state epoch {epoch!r} is not a count of steps")
    own = layout.entries
    if not isinstance(names, list) or names != list(own):
        raise ValueError("state names other tensors than this stage has")
    if not (isinstance(opt_keys, list) and all(isinstance(k, list) and len(k) == 2 and isinstance(k[0], int)
                                                and 0 <= k[0] < len(layout.params) and isinstance(k[1], str)
                                                for k in opt_keys)):
        raise ValueError("state's optimizer entries are malformed")
    if len(tensors) != len(names) + len(opt_keys):
        raise ValueError(f"state has {len(tensors)} tensors, expected {len(names) + len(opt_keys)}")
    for name, t in zip(names, tensors, strict=False):
        shape, dtype = own[name]
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"state's {name} is {t.dtype} {list(t.shape)}, the stage's {dtype} {list(shape)}")
    for (index, key), t in zip(opt_keys, tensors[len(names):], strict=True):
        if t.numel() != 1 and t.shape != layout.params[index]:
            raise ValueError(f"state's optimizer {key} of parameter {index} has shape {list(t.shape)}")
    if not all(all_finite(t) for t in tensors if t.is_floating_point()):
        raise ValueError("state holds NaN or Inf")
    if ledger is not None and not (isinstance(ledger, list) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], list)
            and all(isinstance(i, str) for i in e[1]) for e in ledger)):
        raise ValueError("state's ledger is malformed")
    if "digest" in meta:  # the parameters' checksum
        sent = dict(zip(names, tensors, strict=False))
        if digest([sent[n] for n in layout.trainable]) != meta["digest"]:
            raise ValueError(f"state checksum mismatch: expected {meta['digest']}")


def import_state(rt: StageRuntime, meta: dict, tensors: list[torch.Tensor]) -> int:
    """Load a state in place of the runtime's; the samples of held gradients dropped (`carry`)."""
    check_state(rt.layout, meta, tensors)
    steps = meta.get("ledger", [])
    aside = [ids for _, ids in rt.aside.parts]
    fate = None if rt.asynchronous else carry(rt.pending, aside, rt.epoch, int(meta["epoch"]), steps)
    names, opt_keys = meta["names"], meta["opt_keys"]
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
    lost = carry_over(rt, fate)
    rt.book.restore(steps)
    return lost


def carry_over(rt: StageRuntime, fate: list[bool] | None) -> int:
    """Keep what `fate` says of the held gradients once a state is loaded (`swarm.core.ledger.carry`); the
    samples dropped. Kept graphs go either way: the weights changed by other than a step."""
    if fate is None:
        return rt.discard_gradients()
    rt.book.unpend(rt.aside.give_back(rt.params, fate))  # the loaded step holds the parts not given back
    rt.graphs.drop_all(REPLACED)
    rt.kept.release(())
    return 0


@torch.no_grad()
def unshare(rt: StageRuntime) -> None:
    """If a reader still holds tensors that `export_state` lent it, give the runtime's live ones fresh
    memory, leaving the reader's unchanged. It costs a copy only when a step comes while a checkpoint is
    written or a download is served."""
    if not rt.lent.held():
        return
    for p in rt.module.parameters():
        p.data = p.data.clone()
    for st in rt.optimizer.state.values():
        for key, value in st.items():
            if torch.is_tensor(value):
                st[key] = value.clone()
