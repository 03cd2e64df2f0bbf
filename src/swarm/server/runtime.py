"""A stage's compute: forward, backward, gradient accumulation and the optimizer step.

Everything here is synchronous torch code that runs on the server's single compute thread, so no
locking is needed inside. Networking, batching of requests and scheduling live in `server.py`.

Gradients are accumulated as *sums over samples* (the last stage back-propagates `loss * batch`), so
an all-reduced sum divided by the stage's total sample count is the exact mean gradient of the step,
however unevenly trainers spread their microbatches over the replicas.

Forward graphs are kept so that the backward usually costs one backward pass (the fast path). A kept
graph is only valid for the epoch it was built in: the optimizer step changes the weights in place,
so after a step (or when the graph was evicted, or the backward arrives at another replica) the
backward recomputes the forward from the inputs the trainer sends along. A graph built for a batch
of several requests is back-propagated once for all of them (`backward_batch`): running it once per
request would cost a full batch backward each time.

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
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = (
            NesterovCorrection(self.params, lr=optim.lr, momentum=optim.nag_momentum, weight_decay=optim.weight_decay)
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
        self.last_digest = self.digest()  # of the current weights; replicas at one epoch must agree on it

    def accumulates(self, req_id: str) -> bool:
        """Whether a gradient for `req_id` would be new to the stage's ledger (else it is a duplicate)."""
        return req_id not in self.pending and req_id not in self.committed

    def _hold(self, req_id: str, samples: int) -> None:
        self.pending[req_id] = samples
        self.pending_samples += samples

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
        with self._autocast():
            outputs = self.module(inputs)
        graph = BatchGraph(inputs, outputs, self.epoch, time.monotonic(), {})
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
            self._hold(req_id, x.shape[0])
            grad = None if self.is_first else inputs.grad.cpu()
        else:
            grad = None if self.is_first else torch.autograd.grad(scaled, inputs)[0].cpu()
        return float(loss.detach()), grad

    def live_graph(self, req_id: str) -> BatchGraph | None:
        """The kept graph of a request's forward, if it is still valid for the current weights."""
        graph = self.graphs.get(req_id)
        return graph if graph is not None and graph.epoch == self.epoch else None

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
        self._hold(req_id, x.shape[0])
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
        if graph.epoch != self.epoch:
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
            for r in fresh:
                self._hold(r, graph.rows[r].stop - graph.rows[r].start)
                results[r] = None if self.is_first else graph.inputs.grad[graph.rows[r]].cpu()
        for r in grads.keys() - fresh.keys():
            self.duplicates += 1
            results[r] = self._input_grad(graph.inputs[graph.rows[r]].detach(), grads[r])
        return results

    def evict_stale_graphs(self) -> None:
        """Drop graphs whose backward never came (the trainer died) or that a step made invalid."""
        now = time.monotonic()
        stale = [r for r, g in self.graphs.items() if g.epoch != self.epoch or now - g.created > self.graph_ttl]
        for r in stale:
            del self.graphs[r]

    # ---- the optimizer step ----------------------------------------------------------------------

    def flat_grad(self) -> torch.Tensor:
        """All accumulated gradients as one float32 vector on the CPU (zeros where none arrived yet)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([g.detach().float().reshape(-1).cpu() for g in grads])

    def apply_step(
        self, mean_grad: torch.Tensor, samples: int, group: int, ids: list[str] | None = None
    ) -> StepRecord:
        """Take the optimizer step every replica of the stage takes, from the stage's mean gradient.

        `ids` are the microbatches the whole stage's step took in (this replica's own by default).
        """
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = mean_grad[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype).clone()
            offset += n
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.clip_grad_norm or math.inf))
        lr = warmup_lr(self.epoch, self.optim_cfg.lr, self.optim_cfg.warmup_steps)
        for group_ in self.optimizer.param_groups:
            group_["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        ids = sorted(self.pending) if ids is None else ids
        # the network thread reads the ledger while this runs: commit first, then forget what was
        # pending, then move the epoch, so a reader always finds a microbatch in one or the other
        self._commit(ids, self.epoch + 1)
        self.pending, self.pending_samples = {}, 0
        self.epoch += 1
        self.graphs.clear()
        self.last_digest = self.digest()
        return StepRecord(self.epoch, samples, group, lr, norm, self.last_digest, ids)

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
        """Forget accumulated gradients (they belong to weights this replica no longer holds)."""
        lost = self.pending_samples
        self.optimizer.zero_grad(set_to_none=True)
        self.pending, self.pending_samples = {}, 0
        self.graphs.clear()
        return lost

    def digest(self) -> str:
        return _digest(self.params)

    # ---- state transfer (newcomers and stragglers) ---------------------------------------------

    def state(self) -> tuple[dict, list[torch.Tensor]]:
        """Parameters, buffers and optimizer state, flattened for the wire."""
        names, tensors = [], []
        for name, t in self.module.state_dict().items():
            names.append(name)
            tensors.append(t.detach().cpu().clone())
        opt_keys = []
        for index, st in sorted(self.optimizer.state_dict()["state"].items()):
            for key, value in sorted(st.items()):
                opt_keys.append([index, key])
                tensors.append(torch.as_tensor(value).detach().cpu().clone())
        ledger = [[epoch, ids] for epoch, ids in self.ledger().items()]
        meta = {"epoch": self.epoch, "names": names, "opt_keys": opt_keys, "ledger": ledger, "digest": self.last_digest}
        return meta, tensors

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
        self.module.load_state_dict(dict(zip(names, tensors[: len(names)], strict=True)))
        opt_state = self.optimizer.state_dict()
        opt_state["state"] = {}
        for (index, key), t in zip(opt_keys, tensors[len(names) :], strict=True):
            opt_state["state"].setdefault(index, {})[key] = t
        self.optimizer.load_state_dict(opt_state)
        self.epoch = int(meta["epoch"])
        self.last_digest = self.digest()
        self.discard_gradients()
        self.committed = {}
        for epoch, ids in meta.get("ledger", []):
            self._commit(ids, int(epoch))


def _digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
