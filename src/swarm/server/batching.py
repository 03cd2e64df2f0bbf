"""Forward requests that queue up while the compute thread is busy run as one batch; the backward of
such a batch waits (briefly) for all of its requests' output gradients and runs once for all of them.

On a GPU this pays; on a CPU it does not, and a merged batch's graph must wait for every member's
gradient, so `server.merge_samples` is 0 there and each forward runs alone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from swarm.server.gate import ComputeGate, Deadline
from swarm.server.records import BatchGraph
from swarm.server.runtime import StageRuntime
from swarm.server.turns import SOON
from swarm.wire.validate import Unavailable

log = logging.getLogger("swarm.server")
RECOMPUTE = object()  # the answer for a backward whose kept graph could not be used: recompute it


@dataclass
class _Queued:
    """A forward request waiting for its batch."""

    key: str
    x: torch.Tensor
    future: asyncio.Future
    expires: Deadline
    token: int  # its place in the compute gate's backlog


class Batcher:
    def __init__(self, runtime: StageRuntime, gate: ComputeGate, merge_samples: int, backward_wait: float):
        self.runtime = runtime
        self.gate = gate
        self.limit = merge_samples
        self.backward_wait = backward_wait
        self._queue: list[_Queued] = []
        self._ready = asyncio.Event()
        self._waits: dict[BatchGraph, dict[str, tuple[torch.Tensor, asyncio.Future]]] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    async def forward(self, key: str, x: torch.Tensor, expires: Deadline) -> torch.Tensor:
        """The stage's output for one request, computed in the next batch, unless its caller has given up
        on it by then (`Unavailable`)."""
        queued = _Queued(key, x, asyncio.get_running_loop().create_future(), expires,
                         self.gate.backlog.enqueue("forward", x.shape[0]))
        self._queue.append(queued)
        self._ready.set()
        try:
            return await queued.future
        finally:
            self.gate.backlog.leave(queued.token)

    async def loop(self) -> None:
        """Merge the forward requests queued since the last batch into one, up to `merge_samples`."""
        while True:
            await self._ready.wait()
            async with self.gate.lock:
                batch = self._take_batch()
                if not batch:
                    continue
                try:
                    outputs = await self.gate.run_locked(
                        self.runtime.forward, [(q.key, q.x) for q in batch], work="forward",
                        samples=sum(q.x.shape[0] for q in batch),
                    )
                except Exception as e:
                    log.exception("forward batch failed")
                    for q in batch:
                        if not q.future.done():
                            q.future.set_exception(RuntimeError(f"forward failed: {e}"))
                    continue
                for q, y in zip(batch, outputs, strict=True):
                    if not q.future.done():
                        q.future.set_result(y)

    def _take_batch(self) -> list[_Queued]:
        """The queued requests of the next batch, up to `merge_samples`; requests whose callers gave up
        while they queued are answered as expired and left out (they may be retried elsewhere already)."""
        batch, size = [], 0
        while self._queue and (not batch or size + self._queue[0].x.shape[0] <= self.limit):
            queued = self._queue.pop(0)
            self.gate.backlog.leave(queued.token)
            if queued.future.done():
                continue
            if queued.expires.passed():
                queued.future.set_exception(Unavailable("the request expired while it queued"))
                continue
            batch.append(queued)
            size += queued.x.shape[0]
        if not self._queue:
            self._ready.clear()
        return batch

    async def backward(self, graph: BatchGraph, key: str, dy: torch.Tensor):
        """The input gradient of one request of a batched forward, or RECOMPUTE.

        Requests whose gradient has not come by `backward_wait` are left out and recomputed when it
        comes; so is everyone if a step changed the weights meanwhile."""
        waiting = self._waits.setdefault(graph, {})
        future = asyncio.get_running_loop().create_future()
        waiting[key] = (dy, future)
        if len(waiting) == graph.size:
            self._spawn(self._run_backward(graph))
        elif len(waiting) == 1:
            asyncio.get_running_loop().call_later(self.backward_wait, lambda: self._spawn(self._run_backward(graph)))
        return await future

    def _spawn(self, coro) -> None:
        """Run a background task, holding a reference so it is neither collected nor silently lost."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_backward(self, graph: BatchGraph) -> None:
        waiting = self._waits.pop(graph, None)
        if not waiting:
            return  # already run
        grads = {key: dy for key, (dy, _) in waiting.items()}
        try:
            async with self.gate.lock.turn(SOON):
                if self.runtime.live_graph(next(iter(grads))) is not graph:
                    results = dict.fromkeys(grads, RECOMPUTE)
                else:
                    results = await self.gate.run_locked(
                        self.runtime.backward_batch, graph, grads, work="backward",
                        samples=sum(graph.rows[key].stop - graph.rows[key].start for key in grads),
                    )
        except Exception as e:
            log.exception("batched backward failed")
            results = dict.fromkeys(grads, e)
        for key, (_, future) in waiting.items():
            if future.done():
                continue
            if isinstance(results[key], Exception):
                future.set_exception(results[key])
            else:
                future.set_result(results[key])
