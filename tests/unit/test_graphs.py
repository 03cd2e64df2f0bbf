"""Why a backward found no kept graph to run through: every way a graph goes is told apart, through a real
stage's runtime, so that a run that recomputes backwards says why."""

from __future__ import annotations

import copy

import torch

from swarm.config import ModelConfig, OptimConfig
from swarm.model import load_stages
from swarm.server import graphs
from swarm.server.graphs import BATCHED, EXPIRED, NOT_KEPT, REPLACED, WEIGHTS_CHANGED, KeptGraphs
from swarm.server.records import BatchGraph
from swarm.server.runtime import StageRuntime

SEQ, D_MODEL = 8, 16


def stage_runtime(graph_ttl: float = 120.0) -> StageRuntime:
    cfg = ModelConfig(d_model=D_MODEL, n_heads=2, d_ff=32, n_layers=3, seq_len=SEQ, vocab_size=257, num_stages=3,
                      dropout=0.0)
    return StageRuntime(copy.deepcopy(load_stages(cfg)[1]), OptimConfig(lr=1e-2, warmup_steps=1), graph_ttl=graph_ttl)


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(1, SEQ, D_MODEL, generator=torch.Generator().manual_seed(seed))


def test_each_recomputed_backward_is_counted_under_why_its_graph_was_not_there() -> None:
    rt = stage_runtime()
    x, dy = hidden(1), hidden(2)
    rt.backward("elsewhere", x, dy)  # its forward ran at another replica
    rt.forward([("pair-a", x), ("pair-b", hidden(3))])
    rt.backward("pair-a", x, dy)  # its graph holds another request too: not run through for one
    rt.forward([("replaced", x)])
    rt.discard_gradients()  # as a replica that takes another's state does
    rt.backward("replaced", x, dy)
    assert rt.recomputed == {NOT_KEPT: 1, BATCHED: 1, REPLACED: 1}
    assert rt.recomputed_backwards == 3 and rt.fast_backwards == 0


def test_a_graph_past_its_ttl_is_recomputed_as_expired() -> None:
    rt = stage_runtime(graph_ttl=1e-9)
    x = hidden(1)
    rt.forward([("late", x)])
    rt.forward([("next", hidden(4))])  # each forward first drops the graphs past their ttl
    rt.backward("late", x, hidden(2))
    assert rt.recomputed == {EXPIRED: 1}


def test_graphs_the_weights_moved_away_from_are_dropped_as_weights_changed() -> None:
    kept = KeptGraphs(ttl=120.0)
    graph = BatchGraph(torch.zeros(1), torch.zeros(1), 0.0, {"a": slice(0, 1)}, version=0)
    kept.keep(graph)
    assert kept.why_unusable("a", lambda g: False) == WEIGHTS_CHANGED  # still listed, but useless
    kept.evict(lambda g: g.version == 1)
    assert "a" not in kept and kept.why_unusable("a", lambda g: True) == WEIGHTS_CHANGED
    assert kept.why_unusable("a", lambda g: True) == NOT_KEPT  # told once: the backward that asked took it


def test_only_the_newest_reasons_are_remembered(monkeypatch) -> None:
    monkeypatch.setattr(graphs, "REMEMBERED", 2)
    kept = KeptGraphs(ttl=120.0)
    for req_id in ("first", "second", "third"):
        kept.keep(BatchGraph(torch.zeros(1), torch.zeros(1), 0.0, {req_id: slice(0, 1)}))
    kept.drop_all(REPLACED)
    assert [kept.why_unusable(r, lambda g: True) for r in ("first", "second", "third")] == [
        NOT_KEPT, REPLACED, REPLACED]


def test_a_request_left_out_of_its_batchs_backward_is_recomputed_as_batched() -> None:
    rt = stage_runtime()
    x, dy = hidden(1), hidden(2)
    rt.forward([("served", x), ("left", hidden(3))])
    rt.backward_batch(rt.graphs["served"], {"served": dy})
    rt.backward("left", hidden(3), dy)
    assert rt.recomputed == {BATCHED: 1} and rt.fast_backwards == 1
