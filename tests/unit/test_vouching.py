"""A downloaded state is applied only when the stage's other replicas vouch for its digest: the pure rule,
the choice of whose weights diverged replicas take, and a server's download refusing and setting aside a
replica that serves weights nobody else holds."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch

from swarm.config import load_config
from swarm.core.stepping import CatchUp, Replica, StepView, plan_step
from swarm.core.vouching import LOOKS, keeper, vouched
from swarm.net.directory import Directory
from swarm.results import PeerResults
from swarm.server.gate import ComputeGate
from swarm.server.stage import ServedStage
from swarm.server.stepping import Stepper
from swarm.server.transfer import StateTransfer
from swarm.wire.records import ServerRecord

CFG = load_config(overrides=["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=2",
                             "model.seq_len=16", "model.num_stages=2"])
HASH = "hash"


# ---- the rule ------------------------------------------------------------------------------------------

def test_two_other_replicas_at_the_epoch_vouch_for_a_digest() -> None:
    assert vouched("d", 5, [("a", 5, "d"), ("b", 5, "d")], "me")
    assert vouched("d", 5, [("a", 5, "d"), ("b", 5, "d"), ("c", 5, "x")], "me")


def test_one_replica_among_several_at_the_epoch_does_not() -> None:
    assert not vouched("d", 5, [("a", 5, "d"), ("b", 5, "x")], "me")
    assert not vouched("d", 5, [("a", 5, "d"), ("b", 5, "x"), ("c", 4, "d"), ("e", 6, "d")], "me")  # nor other epochs


def test_the_only_replica_at_its_epoch_is_believed() -> None:
    assert vouched("d", 5, [("a", 5, "d"), ("b", 4, "y")], "me")
    assert not vouched("d", 5, [("a", 5, "x")], "me")
    assert not vouched("d", 5, [], "me")


def test_the_downloader_does_not_vouch_for_itself() -> None:
    assert not vouched("d", 5, [("me", 5, "d"), ("a", 5, "d"), ("b", 5, "x")], "me")
    assert vouched("d", 5, [("me", 5, "x"), ("a", 5, "d")], "me")  # a is then the only other one at 5


def test_a_replica_read_twice_counts_once_and_its_newer_record_counts() -> None:
    # a record read just after a step may still carry the old digest; the next one the new
    assert not vouched("d", 5, [("a", 5, "d"), ("a", 5, "d"), ("b", 5, "old")], "me")
    assert vouched("d", 5, [("a", 5, "d"), ("b", 5, "old"), ("b", 5, "d")], "me")


def test_no_digest_is_never_vouched_for() -> None:
    assert not vouched("", 5, [("a", 5, ""), ("b", 5, "")], "me")


def test_diverged_replicas_take_the_weights_most_of_them_hold() -> None:
    assert keeper({"a": "x", "b": "y", "c": "y"}) == "b"
    assert keeper({"c": "y", "b": "y", "a": "x", "d": "x", "e": "y"}) == "b"
    assert keeper({"b": "y", "a": "x"}) == "a"  # a tie: the digest whose smallest holder is smallest
    assert keeper({"b": "y", "a": "x", "c": "x", "d": "y"}) == "a"


# ---- a server's download -------------------------------------------------------------------------------

class Records(Directory):
    """A DHT view whose reads of the stage return `reads` in turn, the last one from then on."""

    def __init__(self, *reads: list[ServerRecord]):
        super().__init__(None, "run", 6.0)
        self.reads = list(reads)
        self.count = 0

    async def stage(self, stage: int) -> list[ServerRecord]:
        self.count += 1
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


class Client:
    """Serves the state of `source` to every `state` call."""

    def __init__(self, source: ServedStage):
        self.source = source

    async def call(self, peer, method, meta, tensors, timeout):
        return self.source.runtime.state()


def stage(peer: str) -> ServedStage:
    return ServedStage.build(CFG.model, CFG.optim, CFG.server, 1, peer, peer)


def ahead(peer: str, epoch: int) -> ServedStage:
    """A replica at `epoch` holding weights of its own."""
    st = stage(peer)
    with torch.no_grad():
        for p in st.runtime.params:
            p.add_(0.01)
    st.runtime.epoch, st.runtime.last_digest = epoch, st.runtime.digest()
    return st


def record(peer: str, epoch: int, digest: str) -> ServerRecord:
    return ServerRecord(peer, 1, 1.0, 0, epoch, 0, HASH, {}, digest=digest)


def transfer(me: ServedStage, source: ServedStage, directory: Directory, tmp_path: Path) -> StateTransfer:
    return StateTransfer(me, ComputeGate(1.0, False), Client(source), directory, HASH, PeerResults(tmp_path), "me",
                         10.0, 0.001, lambda index: None)


def test_a_state_only_its_sender_announces_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    me, hostile = stage("me"), ahead("hostile", 3)
    before = me.runtime.digest()
    directory = Records([record("hostile", 3, hostile.runtime.last_digest), record("honest", 3, "other weights")])
    moves = transfer(me, hostile, directory, tmp_path)
    assert not asyncio.run(moves.download([record("hostile", 3, hostile.runtime.last_digest)]))
    assert (me.runtime.epoch, me.runtime.digest()) == (0, before)
    assert moves.unvouched == {"hostile"}
    assert directory.count == LOOKS  # it looked again before giving up


def test_a_digest_announced_a_moment_after_the_state_is_served_is_taken(tmp_path: Path) -> None:
    me, source = stage("me"), ahead("a", 3)
    digest = source.runtime.last_digest
    late = [record("a", 3, digest), record("b", 2, "older weights")]
    directory = Records(late, late, [record("a", 3, digest), record("b", 3, digest)])
    moves = transfer(me, source, directory, tmp_path)
    assert asyncio.run(moves.download([record("a", 3, digest)]))
    assert (me.runtime.epoch, me.runtime.digest()) == (3, digest)
    assert moves.unvouched == set()


def test_a_replica_whose_state_was_refused_no_longer_holds_the_catch_up_back(tmp_path: Path) -> None:
    me, hostile = stage("me"), ahead("hostile", 3)
    claim = record("hostile", 3, hostile.runtime.last_digest)
    directory = Records([claim, record("honest", 3, "other weights")])
    stepper = Stepper(me, "me", CFG.optim, CFG.net, 0, ComputeGate(1.0, False), directory, None, None,
                      transfer(me, hostile, directory, tmp_path), PeerResults(tmp_path), "steps", random.Random(0))
    view = StepView(now=0.0, me="me", epoch=0, pending=0, others=(Replica("hostile", 3, 0),), trainers=1,
                    trainers_done=False, proposal=None, target_batch_size=8, grace=1.0)
    assert isinstance(plan_step(view, me.plan)[0], CatchUp)
    asyncio.run(stepper._catch_up([claim]))
    assert me.runtime.epoch == 0
    assert not isinstance(plan_step(view, me.plan)[0], CatchUp)
