"""A stage's compute: forward, backward, gradient accumulation and the optimizer step.

Everything here is synchronous torch code that runs on the server's single compute thread, so no
locking is needed inside. Networking, batching of requests and scheduling live in the other modules of `swarm.server`.

Gradients are accumulated as *sums over samples* (the last stage back-propagates `loss * batch`), so
an all-reduced sum divided by the stage's total sample count is the exact mean gradient of the step,
however unevenly trainers spread their microbatches over the replicas.

Forward graphs are kept so that the backward usually costs one backward pass (the fast path). A kept
graph is only valid for the epoch it was built in: the optimizer step changes the weights in place,
so after a step (or when the graph was evicted, or the backward arrives at another replica) the
backward recomputes the forward from the inputs the trainer sends along. A graph built for a batch
of several requests is back-propagated once for all of them (`backward_batch`): running it once per
request would cost a full batch backward each time.

Asynchronous mode (`optim.mode = "async"`): every accumulating backward applies the optimizer to its
microbatch's mean gradient at once (a local update), and the stage's replicas average their weights
every `target_batch_size` stage samples. Each forward then runs on a copy of the weights it saw (weight
stashing, as in PipeDream): its backward, however many local updates later it comes, is the exact
gradient at those older weights, and is applied to the current ones. That is the staleness asynchrony
brings (the number of updates in between is recorded per gradient), and the one NAG's look-ahead is
meant to absorb. Averaging is by deltas from the last averaged state (the `anchor`, identical on every
replica): each replica sends its progress since then weighted by its samples, and all take
`anchor + mean delta` (the same bits everywhere) plus whatever they learned locally while the round
ran. A replica's un-averaged progress is what its `pending` microbatches hold: they are committed by
the averaging round, and a replica that drops them (it was taken for gone, or loads a peer's state)
returns to its anchor, so a microbatch still counts exactly once in the stage's averaged weights.

Delivery ledger: the runtime knows which microbatches its accumulated gradient holds (`pending`) and
which ones recent steps of the stage took in (`committed`, kept for `LEDGER_EPOCHS` epochs and sent
along with the state). A microbatch already held or committed is never accumulated again: a repeated
or replayed request only gets its input gradient back. That, and the step taking exactly the held
microbatches, is what lets a trainer retry or replay a microbatch without counting it twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from swarm.config import OptimConfig
from swarm.core.schedule import warmup_lr
from swarm.server.nag import NesterovCorrection


@dataclass(eq=False)
class BatchGraph:
    """The autograd graph of one forward batch, awaiting its requests' output gradients."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    epoch: int
    created: float
    rows: dict[str, slice]  # request id -> its rows in the batch
    version: int = 0  # of the weights the forward ran at
    stash: dict[str, torch.Tensor] | None = None  # async: the copy of the weights it ran at

    def valid_for(self, epoch: int) -> bool:
        """A stashed graph holds its own weights; any other holds the live ones, changed by each step."""
        return self.stash is not None or self.epoch == epoch

    @property
    def size(self) -> int:
        return len(self.rows)


LEDGER_EPOCHS = 64  # steps whose microbatch ids a replica remembers (and hands to newcomers)


@dataclass
class StepRecord:
    epoch: int  # the epoch this step produced
    samples: int  # samples of the whole stage that went into it
    group: int  # replicas that took part
    lr: float
    grad_norm: float
    digest: str  # hash of the parameters after the step: equal digests mean bit-identical replicas
    ids: list[str] = field(default_factory=list)  # the microbatches the step took in, stage-wide
    time: float = field(default_factory=time.time)
    # async: how far this replica's weights are from the average right after the round (relative L2
    # norm): the local progress it made while the round ran, which it keeps
    drift: float = 0.0


@dataclass(frozen=True)
class AverageRound:
    """What an async replica brings to an averaging round, taken at one instant of its weights."""

    snapshot: torch.Tensor  # the averaged tensors then, flat
    contribution: torch.Tensor  # (snapshot - anchor) * samples: its progress, weighted by its share
    samples: int
    ids: list[str]  # the microbatches whose gradients that progress holds
    generation: int  # of the anchor it started from (see StageRuntime.discard_gradients)


class StageRuntime:
    def __init__(
        self,
        module: torch.nn.Module,
        optim: OptimConfig,
        device: str = "cpu",
        autocast: str = "none",
        graph_ttl: float = 120.0,
    ):
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.is_first = bool(getattr(module, "is_first", False))
        self.is_last = bool(getattr(module, "is_last", False))
        self.optim_cfg = optim
        self.asynchronous = optim.mode == "async"
        self.param_names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        rms_beta = optim.betas[1] if optim.nag_normalize else None
        self.optimizer = (
            NesterovCorrection(self.params, lr=optim.base_lr, momentum=optim.nag_momentum,
                               weight_decay=optim.weight_decay, rms_beta=rms_beta)
            if optim.optimizer == "nag"
            else torch.optim.AdamW(self.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
        )
        self.autocast_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[autocast]
        self.graph_ttl = graph_ttl
        self.epoch = 0
        self.pending: dict[str, int] = {}  # microbatch id -> samples, accumulated since the last step
        self.pending_samples = 0  # their sum, readable from the network thread without iterating
        self.committed: dict[str, int] = {}  # microbatch id -> the epoch its step produced (recent steps)
        self.duplicates = 0  # requests for microbatches already held or committed: not accumulated again
        self.graphs: dict[str, BatchGraph] = {}  # request id -> the graph holding its forward
        self.fast_backwards = 0
        self.recomputed_backwards = 0
        self.version = 0  # changes of the weights: steps, local updates, averaging rounds
        self.staleness: dict[int, int] = {}  # updates between a gradient's forward and its application -> count
        # async: the averaged tensors as the last round left them (bit-identical on every replica)
        self.anchor = self._flat_averaged() if self.asynchronous else None
        self._generation = 0  # bumped whenever the anchor is replaced or the weights return to it
        self._lent: list[weakref.ref] = []  # the state's tensors as `state` handed them out (see _unshare)
        self.last_digest = self.digest()  # of the stage's agreed weights; replicas at one epoch must agree on it

    def accumulates(self, req_id: str) -> bool:
        """Whether a gradient for `req_id` would be new to the stage's ledger (else it is a duplicate)."""
        return req_id not in self.pending and req_id not in self.committed

    def _hold(self, req_id: str, samples: int, version: int) -> None:
        self.pending[req_id] = samples
        self.pending_samples += samples
        stale = self.version - version
        self.staleness[stale] = self.staleness.get(stale, 0) + 1

    # ---- compute -------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _leaf(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x if self.is_first else x.detach().float().requires_grad_(True)

    def forward(self, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Run several requests as one batch; keep the graph for each request's backward."""
        self.evict_stale_graphs()
        inputs = self._leaf(torch.cat([x for _, x in requests]))
        stash = None
        with self._autocast():
            if self.asynchronous:
                live = zip(self.param_names, self.params, strict=True)
                stash = {n: p.detach().clone().requires_grad_(True) for n, p in live}
                outputs = torch.func.functional_call(self.module, stash, (inputs,))
            else:
                outputs = self.module(inputs)
        graph = BatchGraph(inputs, outputs, self.epoch, time.monotonic(), {}, self.version, stash)
        results, start = [], 0
        for req_id, x in requests:
            graph.rows[req_id] = rows = slice(start, start + x.shape[0])
            self.graphs[req_id] = graph
            results.append(outputs[rows].detach().float().cpu())
            start = rows.stop
        return results

    def forward_backward_last(
        self, req_id: str, x: torch.Tensor, targets: torch.Tensor, accumulate: bool = True
    ) -> tuple[float, torch.Tensor | None]:
        """The last stage: loss, and the gradient with respect to its inputs, in one call."""
        accumulate = accumulate and self.accumulates(req_id)
        if not accumulate:
            self.duplicates += 1
        inputs = self._leaf(x)
        with self._autocast(), torch.set_grad_enabled(accumulate or not self.is_first):
            loss = self.module(inputs, targets.to(self.device))
        scaled = loss.float() * x.shape[0]
        if accumulate:
            scaled.backward()
            self._hold(req_id, x.shape[0], self.version)
            self._local_update(x.shape[0])
            grad = None if self.is_first else inputs.grad.cpu()
        else:
            grad = None if self.is_first else torch.autograd.grad(scaled, inputs)[0].cpu()
        return float(loss.detach()), grad

    def live_graph(self, req_id: str) -> BatchGraph | None:
        """The kept graph of a request's forward, if it is still valid for the current weights."""
        graph = self.graphs.get(req_id)
        return graph if graph is not None and graph.valid_for(self.epoch) else None

    def backward(
        self, req_id: str, x: torch.Tensor, grad_out: torch.Tensor, accumulate: bool = True
    ) -> torch.Tensor | None:
        """Backward of one request: from its kept graph if it was forwarded alone, else recomputed.

        With `accumulate` False (or for a microbatch the ledger already has) only the input gradient
        is computed: the parameters' gradients are left as they are.
        """
        graph = self.live_graph(req_id)
        if accumulate and graph is not None and graph.size == 1:
            return self.backward_batch(graph, {req_id: grad_out})[req_id]
        self.graphs.pop(req_id, None)
        if not (accumulate and self.accumulates(req_id)):
            self.duplicates += 1
            return self._input_grad(x, grad_out)
        inputs = self._leaf(x)
        with self._autocast():
            outputs = self.module(inputs)
        outputs.backward(grad_out.to(self.device))
        self.recomputed_backwards += 1
        self._hold(req_id, x.shape[0], self.version)
        self._local_update(x.shape[0])
        return None if self.is_first else inputs.grad.cpu()

    def _input_grad(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
        """d(loss)/d(inputs) alone, leaving parameter gradients untouched (stage 0 has none to give)."""
        if self.is_first:
            return None
        inputs = self._leaf(x)
        with self._autocast():
            outputs = self.module(inputs)
        return torch.autograd.grad(outputs, inputs, grad_out.to(self.device).to(outputs.dtype))[0].cpu()

    def backward_batch(
        self, graph: BatchGraph, grads: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor | None]:
        """One backward pass through a batch graph for the requests in `grads` (others count as zero).

        The graph is consumed: requests of it whose gradient comes later are recomputed.
        """
        if not graph.valid_for(self.epoch):
            raise ValueError("the graph was built with weights this replica no longer holds")
        for req_id in graph.rows:
            self.graphs.pop(req_id, None)
        fresh = {r: dy for r, dy in grads.items() if self.accumulates(r)}
        results: dict[str, torch.Tensor | None] = {}
        if fresh:
            full = torch.zeros_like(graph.outputs, dtype=torch.float32)
            for req_id, dy in fresh.items():
                full[graph.rows[req_id]] = dy.to(self.device)
            graph.outputs.backward(full.to(graph.outputs.dtype))
            self.fast_backwards += len(fresh)
            samples = 0
            for r in fresh:
                rows = graph.rows[r]
                samples += rows.stop - rows.start
                self._hold(r, rows.stop - rows.start, graph.version)
                results[r] = None if self.is_first else graph.inputs.grad[rows].cpu()
            if graph.stash is not None:  # the gradient at the stashed weights, applied to the live ones
                for p, name in zip(self.params, self.param_names, strict=True):
                    p.grad = graph.stash[name].grad
            self._local_update(samples)
        for r in grads.keys() - fresh.keys():
            self.duplicates += 1
            results[r] = self._input_grad(graph.inputs[graph.rows[r]].detach(), grads[r])
        return results

    def evict_stale_graphs(self) -> None:
        """Drop graphs whose backward never came (the trainer died) or that a step made invalid."""
        now = time.monotonic()
        stale = [r for r, g in self.graphs.items() if not g.valid_for(self.epoch) or now - g.created > self.graph_ttl]
        for r in stale:
            del self.graphs[r]

    # ---- the optimizer step ----------------------------------------------------------------------

    def flat_grad(self) -> torch.Tensor:
        """All accumulated gradients as one float32 vector on the CPU (zeros where none arrived yet).

        On a CPU stage of float32 parameters the gradients move into the vector: each `p.grad` becomes
        a view of it, so the round costs no second copy of the stage's gradients, and a round that fails
        leaves them in place for the next (backwards in between add to them there)."""
        if not all(p.device.type == "cpu" and p.dtype == torch.float32 for p in self.params):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            return torch.cat([g.detach().float().reshape(-1).cpu() for g in grads])
        flat = self._grad_vector()
        if flat is None:
            flat = torch.empty(sum(p.numel() for p in self.params))
            offset = 0
            for p in self.params:
                view = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view  # the old gradient is freed here: at most one tensor is held twice
                offset += p.numel()
        return flat

    def _grad_vector(self) -> torch.Tensor | None:
        """The vector an earlier `flat_grad` made every gradient a view of, if they still are."""
        first = self.params[0].grad if self.params else None
        base = None if first is None else first._base
        offset = 0
        for p in self.params:
            if base is None or p.grad is None or p.grad._base is not base or p.grad.storage_offset() != offset:
                return None
            offset += p.numel()
        return base if base.numel() == offset else None

    def _optimizer_step(self) -> float:
        """Clip the gradients in `p.grad`, step at the epoch's warm-up lr, clear them; the pre-clip norm."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.clip_grad_norm or math.inf))
        self._unshare()
        lr = self.lr()
        for group_ in self.optimizer.param_groups:
            group_["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return norm

    def lr(self) -> float:
        return warmup_lr(self.epoch, self.optim_cfg.base_lr, self.optim_cfg.warmup_steps)

    def _local_update(self, samples: int) -> None:
        """Async: apply the microbatch's gradient (a sum over its samples, in `p.grad`) as its mean, now.
        Sync: nothing; it waits in `p.grad` for the stage's step."""
        if not self.asynchronous:
            return
        for p in self.params:
            if p.grad is not None:
                p.grad = p.grad / samples
        self._optimizer_step()

    def apply_step(
        self, mean_grad: torch.Tensor, samples: int, group: int, ids: list[str] | None = None
    ) -> StepRecord:
        """Take the optimizer step every replica of the stage takes, from the stage's mean gradient.

        `ids` are the microbatches the whole stage's step took in (this replica's own by default).
        """
        offset = 0
        for p in self.params:
            mean = mean_grad[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = mean.to(device=p.device, dtype=p.dtype).clone()
            else:  # in place: the gradient's memory (see flat_grad) takes the mean, no second copy
                p.grad.copy_(mean)
            offset += p.numel()
        lr = self.lr()
        norm = self._optimizer_step()
        ids = sorted(self.pending) if ids is None else ids
        # the network thread reads the ledger while this runs: commit first, then forget what was
        # pending, then move the epoch, so a reader always finds a microbatch in one or the other
        self._commit(ids, self.epoch + 1)
        self.pending, self.pending_samples = {}, 0
        self.epoch += 1
        self.graphs.clear()
        self.last_digest = self.digest()
        return StepRecord(self.epoch, samples, group, lr, norm, self.last_digest, ids)

    # ---- async: averaging rounds -----------------------------------------------------------------

    def _averaged(self) -> list[torch.Tensor]:
        """The tensors replicas average: the parameters, and NAG's `w_t` (without it, the shift an
        average makes to the served look-ahead point would enter the next correction as velocity).
        AdamW's moments stay each replica's own: statistics of its own gradients, which only scale its
        steps, and averaging them would triple a round's traffic."""
        tensors = list(self.params)
        if isinstance(self.optimizer, NesterovCorrection):
            tensors += [self.optimizer.state[p]["base"] for p in self.params]
        return tensors

    def _flat_averaged(self) -> torch.Tensor:
        return torch.cat([t.detach().float().reshape(-1).cpu() for t in self._averaged()])

    @torch.no_grad()
    def _set_averaged(self, flat: torch.Tensor) -> None:
        self._unshare()
        offset = 0
        for t in self._averaged():
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t).to(device=t.device, dtype=t.dtype))
            offset += n

    def begin_average(self) -> AverageRound:
        """This replica's part of an averaging round, as its weights stand now (it goes on updating)."""
        snapshot = self._flat_averaged()
        samples = self.pending_samples
        return AverageRound(snapshot, (snapshot - self.anchor) * samples, samples,
                            sorted(self.pending), self._generation)

    def finish_average(
        self, own: AverageRound, mean_delta: torch.Tensor, samples: int, group: int, ids: list[str]
    ) -> StepRecord:
        """Move the anchor by the stage's mean delta and keep the local progress made since `own` was
        taken. The new anchor is the same bits on every replica of the round; the live weights differ
        from it by that local progress only (`drift`)."""
        anchor = self.anchor + mean_delta
        current = self._flat_averaged()
        # local progress since the snapshot is kept, unless the weights were meanwhile reset to the anchor
        live = anchor + (current - own.snapshot) if own.generation == self._generation else anchor
        self._set_averaged(live)
        self.anchor = anchor
        self._generation += 1
        self._commit(ids, self.epoch + 1)
        for req_id in own.ids:
            self.pending_samples -= self.pending.pop(req_id, 0)
        self.epoch += 1
        self.version += 1
        self.last_digest = self.digest()
        drift = float((live - anchor).norm() / anchor.norm().clamp_min(1e-12))
        return StepRecord(self.epoch, samples, group, self.lr(), float(mean_delta.norm()), self.last_digest, ids,
                          drift=drift)

    def _commit(self, ids: list[str], epoch: int) -> None:
        for req_id in ids:
            self.committed[req_id] = epoch
        oldest = epoch - LEDGER_EPOCHS
        while self.committed:  # insertion order is epoch order: forget from the front
            first = next(iter(self.committed))
            if self.committed[first] > oldest:
                break
            del self.committed[first]

    def discard_gradients(self) -> int:
        """Forget accumulated gradients (they belong to weights this replica no longer holds); async,
        the local progress they made: the weights return to the anchor."""
        lost = self.pending_samples
        self.optimizer.zero_grad(set_to_none=True)
        if self.asynchronous and lost:
            self._set_averaged(self.anchor)
            self._generation += 1
            self.version += 1
        self.pending, self.pending_samples = {}, 0
        self.graphs.clear()
        return lost

    def digest(self) -> str:
        """Of the weights the stage agreed on: the parameters (sync) or their anchor (async)."""
        return _digest(self._agreed_params())

    def _agreed_params(self) -> list[torch.Tensor]:
        return self._anchor_views()[: len(self.params)] if self.asynchronous else self.params

    def _anchor_views(self) -> list[torch.Tensor]:
        """The anchor cut into the shapes of the averaged tensors (async)."""
        views, offset = [], 0
        for t in self._averaged():
            views.append(self.anchor[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return views

    # ---- state transfer (newcomers and stragglers) ---------------------------------------------

    def state(self) -> tuple[dict, list[torch.Tensor]]:
        """Parameters, buffers and optimizer state, flattened for the wire. Async, the averaged tensors
        are sent as the anchor holds them: a replica's un-averaged progress stays its own (its pending
        microbatches would otherwise count twice in the next round).

        The parameters and optimizer state are lent, not copied: a copy would cost as much memory again
        as the stage's weights and optimizer state, on every checkpoint and every download served. They
        stay as they are while the reader holds them: the runtime moves its own to fresh memory before
        it next changes them in place, if by then a reader still holds them (`_unshare`). Buffers, which
        a forward may change in place (running statistics), are copied."""
        agreed = dict(zip(map(id, self._averaged()), self._anchor_views(), strict=True)) if self.asynchronous else {}
        self._lent = [ref for ref in self._lent if ref() is not None]
        names, tensors = [], []
        for name, t in self.module.state_dict(keep_vars=True).items():
            names.append(name)
            value = agreed.get(id(t), t)
            tensors.append(self._lend(value) if isinstance(t, torch.nn.Parameter) else value.detach().cpu().clone())
        opt_keys = []
        for index, st in sorted(self.optimizer.state_dict()["state"].items()):
            for key, value in sorted(st.items()):
                opt_keys.append([index, key])
                tensors.append(self._lend(torch.as_tensor(agreed.get(id(value), value))))
        ledger = [[epoch, ids] for epoch, ids in self.ledger().items()]
        meta = {"epoch": self.epoch, "names": names, "opt_keys": opt_keys, "ledger": ledger, "digest": self.last_digest}
        return meta, tensors

    def _lend(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` for a reader outside the compute thread, remembered until the reader drops it."""
        lent = tensor.detach().cpu()
        self._lent.append(weakref.ref(lent))
        return lent

    @torch.no_grad()
    def _unshare(self) -> None:
        """Before the parameters or optimizer state change in place: if a reader still holds tensors that
        `state` lent it, give the live ones fresh memory, leaving the reader's unchanged. It costs a copy
        only when a step comes while a checkpoint is written or a download is served."""
        held = any(ref() is not None for ref in self._lent)
        self._lent = []
        if not held:
            return
        for p in self.module.parameters():
            p.data = p.data.clone()
        for st in self.optimizer.state.values():
            for key, value in st.items():
                if torch.is_tensor(value):
                    st[key] = value.clone()

    def ledger(self) -> dict[int, list[str]]:
        """The microbatches of each remembered step, by the epoch it produced."""
        steps: dict[int, list[str]] = {}
        for req_id, epoch in self.committed.items():
            steps.setdefault(epoch, []).append(req_id)
        return {epoch: sorted(ids) for epoch, ids in sorted(steps.items())}

    def load_state(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        names, opt_keys = meta["names"], meta["opt_keys"]
        if len(tensors) != len(names) + len(opt_keys):
            raise ValueError(f"state has {len(tensors)} tensors, expected {len(names) + len(opt_keys)}")
        if "digest" in meta:  # the parameters' checksum, checked before anything is loaded
            sent = dict(zip(names, tensors, strict=False))
            trainable = [sent.get(n) for n, p in self.module.named_parameters() if p.requires_grad]
            if any(t is None for t in trainable) or _digest(trainable) != meta["digest"]:
                raise ValueError(f"state checksum mismatch: expected {meta['digest']}")
        self._unshare()
        self.module.load_state_dict(dict(zip(names, tensors[: len(names)], strict=True)))
        opt_state = self.optimizer.state_dict()
        opt_state["state"] = {}
        for (index, key), t in zip(opt_keys, tensors[len(names) :], strict=True):
            opt_state["state"].setdefault(index, {})[key] = t
        self.optimizer.load_state_dict(opt_state)
        self.epoch = int(meta["epoch"])
        if self.asynchronous:
            self.anchor = self._flat_averaged()
            self._generation += 1
        self.version += 1
        self.last_digest = self.digest()
        self.discard_gradients()
        self.committed = {}
        for epoch, ids in meta.get("ledger", []):
            self._commit(ids, int(epoch))


def _digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())  # the bytes in place, not a copy
    return h.hexdigest()[:16]
