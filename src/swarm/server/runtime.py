"""A stage's compute: forward, backward, gradient accumulation and the optimizer step.

Synchronous torch code on the server's single compute thread, so no locking is needed inside; networking,
batching of requests and scheduling live in `swarm.server`'s other modules. Delivery ledger: `swarm.core.ledger`.

Gradients are accumulated as *sums over samples* (the last stage back-propagates `loss * batch`), so an
all-reduced sum divided by the stage's total sample count is the exact mean gradient of the step, however
unevenly trainers spread their microbatches over the replicas.

Forward graphs are kept so that the backward usually costs one backward pass (the fast path), and with
them the stage's inputs, which a backward to this replica then need not carry. A step that comes between a
forward and its backward does not spoil the graph: the weights it ran at are kept for it
(`swarm.server.stash`), so its backward is the exact gradient at those weights, accumulated into the step
that follows. Only an evicted graph, a weight change other than a step, or a backward that arrives at another
replica makes it recompute the forward from its inputs (`swarm.server.graphs`). A graph built for a batch of
several requests is back-propagated once for all of them (`backward_batch`), not once per request. A stage
computing in fp16 back-propagates through its replica's own loss scale (`swarm.server.lossscale`).

Asynchronous mode (`optim.mode = "async"`): every accumulating backward applies the optimizer to its microbatch's
mean gradient at once (a local update). Each forward runs on a copy of the weights it saw (weight stashing, as in
PipeDream): its backward, however many local updates later it comes, is the exact gradient at those older weights,
applied to the current ones (the updates in between recorded per gradient). Averaging: `swarm.server.anchor`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from functools import partial

import torch

from swarm.config import OptimConfig
from swarm.core.ledger import Ledger
from swarm.core.schedule import warmup_lr
from swarm.server.anchor import Anchor, AverageRound, averaged
from swarm.server.device import autocast_dtype, prepare
from swarm.server.gradvec import SetAside, take_vector
from swarm.server.graphs import REPLACED, KeptGraphs
from swarm.server.lossscale import LossScale, backprop
from swarm.server.nag import stage_optimizer
from swarm.server.records import BatchGraph, StepPart, StepRecord
from swarm.server.staleness import Staleness
from swarm.server.stash import KeptWeights
from swarm.server.state_io import Lender, StateLayout, export_state, import_state, unshare
from swarm.server.weights_hash import digest
from swarm.wire.codecs import Policy, on_host

LEDGER_EPOCHS = 64  # steps whose microbatch ids a replica remembers (and hands to newcomers)


class StageRuntime:
    def __init__(
        self,
        module: torch.nn.Module,
        optim: OptimConfig,
        device: str = "cpu",
        autocast: str = "auto",
        graph_ttl: float = 120.0,
        wire: Policy | None = None,
        fp16_scale: LossScale | None = None,  # backwards' loss scale where the compute runs in fp16
    ):
        self.device = prepare(torch.device(device))
        self.wire = wire  # the codecs results leave the compute thread packed with (see `on_host`)
        self.module = module.to(self.device)
        self.is_first = bool(getattr(module, "is_first", False))
        self.is_last = bool(getattr(module, "is_last", False))
        self.optim_cfg = optim
        self.asynchronous = optim.mode == "async"
        self.layout = StateLayout.of(self.module)  # what a state loaded here must hold; its trainable parameters' names
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = stage_optimizer(self.params, optim)
        self.autocast_dtype = autocast_dtype(autocast, self.device)
        self.loss_scale = (fp16_scale or LossScale()) if self.autocast_dtype == torch.float16 else None
        self.epoch = 0
        self.book = Ledger(LEDGER_EPOCHS)  # the microbatches held (pending) and stepped (committed)
        self.aside = SetAside()  # a failed round's part, held apart (see `return_part`)
        self.duplicates = 0  # requests for microbatches already held or committed: not accumulated again
        self.graphs = KeptGraphs(graph_ttl)  # request id -> the graph holding its forward
        self.fast_backwards = 0
        self.recomputed: Counter[str] = Counter()  # backwards recomputed, by why no kept graph served
        self.version = 0  # changes of the weights: steps, local updates, averaging rounds
        self.kept = KeptWeights(self.params, lambda: self.version)  # sync: weights overtaken graphs ran at
        self.staleness = Staleness(at_backward=self.asynchronous)
        agreed = partial(averaged, self.params, self.optimizer)  # async: the tensors replicas average, and
        self.averaging = Anchor(agreed, self.unshare) if self.asynchronous else None  # as the last round left them
        self.lent = Lender()  # the state's tensors as `state` handed them out (see unshare)
        self.last_digest = self.digest()  # of the stage's agreed weights; replicas at one epoch must agree on it

    @property
    def pending(self) -> dict[str, int]:
        return self.book.pending

    @property
    def pending_samples(self) -> int:
        return self.book.pending_samples

    @property
    def committed(self) -> dict[str, int]:
        return self.book.committed

    def accumulates(self, req_id: str) -> bool:
        """Whether a gradient for `req_id` would be new to the stage's ledger (else it is a duplicate)."""
        return self.book.accumulates(req_id)

    def _hold(self, req_id: str, samples: int, version: int) -> None:
        self.book.hold(req_id, samples)
        self.staleness.held(req_id, version, self.version)

    # ---- compute -------------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.autocast_dtype is None else torch.autocast(
            self.device.type, dtype=self.autocast_dtype)

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x if self.is_first else x.detach().float().requires_grad_(True)

    def forward(self, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Run several requests as one batch; keep the graph for each request's backward."""
        self.evict_stale_graphs()
        inputs = self.leaf(torch.cat([x for _, x in requests]))
        stash = None
        with self.autocast():
            if self.asynchronous:
                live = zip(self.layout.trainable, self.params, strict=True)
                stash = {n: p.detach().clone().requires_grad_(True) for n, p in live}
                outputs = torch.func.functional_call(self.module, stash, (inputs,))
            else:
                with self.kept.saving():
                    outputs = self.module(inputs)
        graph = BatchGraph(inputs, outputs, time.monotonic(), {}, self.version, stash)
        results, start = [], 0
        for req_id, x in requests:
            graph.rows[req_id] = rows = slice(start, start + x.shape[0])
            results.append(on_host(self.wire, "activations", outputs[rows]))
            start = rows.stop
        self.graphs.keep(graph)
        return results

    def forward_backward_last(
        self, req_id: str, x: torch.Tensor, targets: torch.Tensor, accumulate: bool = True
    ) -> tuple[float, torch.Tensor | None]:
        """The last stage: loss, and the gradient with respect to its inputs, in one call."""
        accumulate = accumulate and self.accumulates(req_id)
        if not accumulate:
            self.duplicates += 1
        inputs = self.leaf(x)
        with self.autocast(), torch.set_grad_enabled(accumulate or not self.is_first):
            loss = self.module(inputs, targets.to(self.device))
        grad = backprop(self.loss_scale, loss.float() * x.shape[0], None, inputs, self.params if accumulate else [])
        if accumulate:
            self._hold(req_id, x.shape[0], self.version)
            self._local_update(x.shape[0])
        return float(loss.detach()), None if grad is None else on_host(self.wire, "gradients", grad)

    def evaluate(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | float:
        """A forward pass that leaves no trace (validation): no graph, gradient or ledger entry, dropout
        off. The last stage returns its loss, the others their outputs."""
        training = self.module.training
        try:
            with torch.no_grad(), self.autocast():
                out = self.module.eval()(self.leaf(x), *([] if targets is None else [targets.to(self.device)]))
        finally:
            self.module.train(training)
        return on_host(self.wire, "activations", out) if targets is None else float(out)

    def live_graph(self, req_id: str) -> BatchGraph | None:
        """The kept graph of a request's forward, if it is still valid for the current weights."""
        graph = self.graphs.get(req_id)
        return graph if graph is not None and self._usable(graph) else None

    def kept_inputs(self, req_id: str) -> torch.Tensor | None:
        """A request's forward inputs while its graph is kept, valid or not (a recomputation needs only them)."""
        graph = self.graphs.get(req_id)
        return None if graph is None else graph.inputs.detach()[graph.rows[req_id]]

    def _usable(self, graph: BatchGraph) -> bool:
        """A stashed graph holds its own weights; any other needs the live ones unchanged since its
        forward, or their copy kept at the step that changed them."""
        return graph.stash is not None or graph.version == self.version or self.kept.holds(graph.version)

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
        if not (accumulate and self.accumulates(req_id)):
            self.graphs.pop(req_id, None)
            self.duplicates += 1
            return self._input_grad(x, grad_out)
        self.recomputed[self.graphs.why_unusable(req_id, self._usable)] += 1
        self.graphs.pop(req_id, None)
        inputs = self.leaf(x)
        with self.autocast():
            outputs = self.module(inputs)
        grad = backprop(self.loss_scale, outputs, grad_out, inputs, self.params)
        self._hold(req_id, x.shape[0], self.version)
        self._local_update(x.shape[0])
        return None if grad is None else on_host(self.wire, "gradients", grad)

    def _input_grad(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
        """d(loss)/d(inputs) alone, leaving parameter gradients untouched (stage 0 has none to give)."""
        if self.is_first:
            return None
        inputs = self.leaf(x)
        with self.autocast():
            outputs = self.module(inputs)
        return on_host(self.wire, "gradients", backprop(self.loss_scale, outputs, grad_out, inputs, []))

    def backward_batch(
        self, graph: BatchGraph, grads: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor | None]:
        """One backward pass through a batch graph for the requests in `grads` (others count as zero).

        The graph is consumed: requests of it whose gradient comes later are recomputed.
        """
        if not self._usable(graph):
            raise ValueError("the graph was built with weights this replica no longer holds")
        self.graphs.consume(graph, grads)
        fresh = {r: dy for r, dy in grads.items() if self.accumulates(r)}
        results: dict[str, torch.Tensor | None] = {}
        if fresh:
            full = torch.zeros_like(graph.outputs, dtype=torch.float32)
            for req_id, dy in fresh.items():
                full[graph.rows[req_id]] = dy.to(self.device)
            leaves = self.params if graph.stash is None else [graph.stash[n] for n in self.layout.trainable]
            grad = backprop(self.loss_scale, graph.outputs, full, graph.inputs, leaves)
            self.fast_backwards += len(fresh)
            samples = 0
            for r in fresh:
                rows = graph.rows[r]
                samples += rows.stop - rows.start
                self._hold(r, rows.stop - rows.start, graph.version)
                results[r] = None if grad is None else on_host(self.wire, "gradients", grad[rows])
            if graph.stash is not None:  # the gradient at the stashed weights, applied to the live ones
                for p, name in zip(self.params, self.layout.trainable, strict=True):
                    p.grad = graph.stash[name].grad
            self._local_update(samples)
        for r in grads.keys() - fresh.keys():
            self.duplicates += 1
            results[r] = self._input_grad(graph.inputs[graph.rows[r]].detach(), grads[r])
        self._release_kept()
        return results

    @property
    def recomputed_backwards(self) -> int:
        return sum(self.recomputed.values())

    def evict_stale_graphs(self) -> None:
        self.graphs.evict(self._usable)
        self._release_kept()

    def _release_kept(self) -> None:
        self.kept.release(g.version for g in self.graphs.values())

    # ---- the optimizer step ----------------------------------------------------------------------

    def begin_step(self) -> StepPart:
        """This replica's part of a sync round; backwards go on while it runs, into the next step. After a
        failed round, the part that round sent, again and alone (see `SetAside`)."""
        if self.aside.parts:
            flat, ids = self.aside.take()
            return StepPart(flat, sum(self.pending[req_id] for req_id in ids), ids)
        return StepPart(take_vector(self.params), *self.aside.outside(self.pending))

    def return_part(self, own: StepPart) -> None:
        """A failed round's part, held apart for the retry (see `SetAside`)."""
        self.aside.add(own.flat, own.ids)

    def _optimizer_step(self) -> float:
        """Clip the gradients in `p.grad`, step at the epoch's warm-up lr, clear them; the pre-clip norm."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.clip_grad_norm or math.inf))
        if math.isfinite(norm):  # else the weights would become NaN: no update (every replica sees the same mean)
            self.unshare()
            for group_ in self.optimizer.param_groups:
                group_["lr"] = self.lr()
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
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
        self, mean_grad: torch.Tensor, samples: int, group: int, ids: list[str] | None = None,
        own: StepPart | None = None,
    ) -> StepRecord:
        """Take the optimizer step every replica of the stage takes, from the stage's mean gradient.
        `ids`: the microbatches the whole stage's step took in; `own`: this replica's part of the round,
        whose gradients accumulated since stay for the next step (without: the step takes all it holds)."""
        taken = self.aside.outside(self.pending)[1] if own is None else own.ids
        ids = taken if ids is None else ids
        meanwhile = [None if own is None else p.grad for p in self.params]
        for p, part in zip(self.params, mean_grad.split([p.numel() for p in self.params]), strict=True):
            p.grad = part.view_as(p).to(device=p.device, dtype=p.dtype, copy=True)
        record = self._take_step(samples, group, ids, taken)
        for p, grad in zip(self.params, meanwhile, strict=True):
            p.grad = grad
        self.aside.give_back(self.params)  # stepped without them: they count in the next step
        return record

    def step_alone(self) -> StepRecord:
        """A replica alone in its round: its mean gradient, divided where it lies (the gate held throughout)."""
        samples, ids = self.aside.outside(self.pending)
        for p in self.params:
            if p.grad is None:  # as in a round's vector: zeros, which the optimizer steps like any gradient
                p.grad = torch.zeros_like(p)
            else:
                p.grad.div_(max(samples, 1))
        record = self._take_step(samples, 1, ids, ids)
        self.aside.give_back(self.params)
        return record

    def _take_step(self, samples: int, group: int, ids: list[str], taken: list[str]) -> StepRecord:
        """Step from the mean gradient in `p.grad`, then move the stage's books and epoch past it."""
        lr = self.lr()
        if any(g.version == self.version for g in self.graphs.values()):
            self.kept.keep()  # forwards at these weights still wait for their backwards
        self.staleness.applied(taken, self.version, self.pending)
        norm = self._optimizer_step()
        # commit, unpend, then move the epoch: a ledger read meanwhile (network thread) finds each microbatch
        self.book.commit(ids, self.epoch + 1)
        self.book.unpend(taken)
        self.epoch += 1
        self.evict_stale_graphs()
        self.last_digest = self.digest()
        return StepRecord(self.epoch, samples, group, lr, norm, self.last_digest, ids)

    # ---- async: averaging rounds -----------------------------------------------------------------

    def begin_average(self) -> AverageRound:
        """This replica's part of an averaging round, as its weights stand now (it goes on updating)."""
        return self.averaging.begin(self.pending_samples, sorted(self.pending), self.version)

    def finish_average(
        self, own: AverageRound, mean_delta: torch.Tensor, samples: int, group: int, ids: list[str]
    ) -> StepRecord:
        """Take the stage's average, keep the local progress made since `own` was taken (`drift`)."""
        drift = self.averaging.finish(own, mean_delta)
        updates = self.version - own.version
        self.book.commit(ids, self.epoch + 1)
        self.book.unpend(own.ids)
        self.epoch += 1
        self.version += 1
        self.last_digest = self.digest()
        return StepRecord(self.epoch, samples, group, self.lr(), float(mean_delta.norm()), self.last_digest, ids,
                          drift=drift, local_updates=updates)

    def discard_gradients(self) -> int:
        """Forget accumulated gradients (they belong to weights this replica no longer holds); async,
        the local progress they made: the weights return to the anchor."""
        lost = self.pending_samples
        self.optimizer.zero_grad(set_to_none=True)
        self.aside = SetAside()
        if self.asynchronous and lost:
            self.averaging.return_to()
            self.version += 1
        self.book.clear_pending()
        self.graphs.drop_all(REPLACED)
        self._release_kept()
        return lost

    def digest(self) -> str:
        """Of the weights the stage agreed on: the parameters (sync) or their anchor (async)."""
        return digest(self.averaging.views()[: len(self.params)] if self.asynchronous else self.params)

    # ---- state transfer (newcomers and stragglers) ---------------------------------------------

    def state(self) -> tuple[dict, list[torch.Tensor]]:
        """Parameters, buffers and optimizer state, flattened for the wire (see swarm.server.state_io)."""
        return export_state(self)

    def load_state(self, meta: dict, tensors: list[torch.Tensor]) -> int:
        """Take another replica's state; the samples of held gradients dropped (see `swarm.core.ledger.carry`)."""
        return import_state(self, meta, tensors)

    def unshare(self) -> None:
        """Before the parameters or optimizer state change in place (see `swarm.server.state_io.unshare`)."""
        unshare(self)
