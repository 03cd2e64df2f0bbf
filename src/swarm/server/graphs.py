"""The forward graphs a server keeps for their backwards, and why a backward found none to use.

A backward is recomputed from its inputs when its forward's graph is not here to be used: the forward ran
at another replica or before this server served the stage ("not kept here"); its backward did not come
within `server.graph_ttl` ("expired"); a step changed the weights it ran at and none were kept for it
("weights changed"); the replica took other weights or dropped its gradients ("state replaced"); or it ran
in a batch with other requests, whose backward ran without it or which it was asked for alone ("batched").
Each costs a forward pass, so a server counts its recomputations by reason: a run that recomputes says why.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from swarm.server.records import BatchGraph

NOT_KEPT, EXPIRED, WEIGHTS_CHANGED, REPLACED, BATCHED = (
    "not kept here", "expired", "weights changed", "state replaced", "batched")
REMEMBERED = 4096  # requests whose graph went before their backward came, newest first: why each went


class KeptGraphs(dict[str, BatchGraph]):
    """Request id -> the graph of its forward, awaiting its backward."""

    def __init__(self, ttl: float):
        super().__init__()
        self.ttl = ttl
        self._gone: OrderedDict[str, str] = OrderedDict()

    def keep(self, graph: BatchGraph) -> None:
        for req_id in graph.rows:
            self[req_id] = graph

    def consume(self, graph: BatchGraph, served: Collection[str]) -> None:
        """A batch graph's backward ran for the requests `served`: the others in it can no longer use it."""
        for req_id in graph.rows:
            if req_id in served:
                self.pop(req_id, None)
            else:
                self.drop(req_id, BATCHED)

    def evict(self, usable: Callable[[BatchGraph], bool]) -> None:
        """Drop the graphs the weights moved away from, and those whose backward never came (its trainer
        died or gave up on it)."""
        now = time.monotonic()
        for req_id, graph in list(self.items()):
            if not usable(graph):
                self.drop(req_id, WEIGHTS_CHANGED)
            elif now - graph.created > self.ttl:
                self.drop(req_id, EXPIRED)

    def drop_all(self, why: str) -> None:
        for req_id in list(self):
            self.drop(req_id, why)

    def drop(self, req_id: str, why: str) -> None:
        if self.pop(req_id, None) is None:
            return
        self._gone[req_id] = why
        while len(self._gone) > REMEMBERED:
            self._gone.popitem(last=False)

    def why_unusable(self, req_id: str, usable: Callable[[BatchGraph], bool]) -> str:
        """Why the backward of `req_id` gets no kept graph to run through (it is about to be recomputed)."""
        graph = self.get(req_id)
        if graph is None:
            return self._gone.pop(req_id, NOT_KEPT)
        return BATCHED if usable(graph) else WEIGHTS_CHANGED
