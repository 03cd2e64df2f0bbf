"""The trainer's server choice per stage follows `trainer.routing`, with bans and preferences, and the
latencies it measures per server from its own calls."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch

from swarm.config import agreed, config_hash, load_config
from swarm.core.routing import LATENCY_ALPHA, MAX_LATENCY_RATIO, Candidate, awaiting_first_answer
from swarm.net.transport import CallFailed
from swarm.trainer.calls import StageCaller
from swarm.trainer.view import LAPSE_MARGIN, SwarmView, until_next_view
from swarm.wire.records import ServerRecord


def _trainer(routing: str, servers=(("a", 1.0), ("b", 3.0)), client=None, *overrides: str) -> StageCaller:
    cfg = load_config(overrides=[f'trainer.routing="{routing}"', "model.num_stages=2", *overrides])
    view = SwarmView(2, config_hash(cfg), agreed(cfg), 1.0)
    view.servers[0] = [ServerRecord(peer, 0, throughput, 0, 0, 0, config_hash(cfg), {}) for peer, throughput in servers]
    return StageCaller(cfg.trainer, client, None, view, config_hash(cfg), 1.0, random.Random(0), asyncio.Event())


class _FakeClient:
    """Answers each server's calls after that server's delay; servers in `failing` time out instead.
    `clock` runs by the delays alone: a trainer whose calls follow one another is timed by it (`timing`)
    where a loaded machine's wall clock would add its stalls to whichever call they fell in."""

    def __init__(self, delays: dict[str, float]):
        self.delays = delays
        self.failing: set[str] = set()
        self.calls: Counter = Counter()
        self.clock = 0.0

    def timing(self, trainer: StageCaller) -> StageCaller:
        trainer.clock = lambda: self.clock
        return trainer

    async def call(self, peer, method, meta, tensors, timeout, unpack=True):
        self.calls[peer] += 1
        await asyncio.sleep(self.delays[peer])
        self.clock += self.delays[peer]
        if peer in self.failing:
            raise CallFailed(f"{method} timed out", timed_out=True)
        return {"epoch": 0}, []


def test_round_robin_routing_gives_exact_shares_per_cycle():
    trainer = _trainer("wrr")
    for peer in ("a", "b"):  # both have answered: their announcements count in full
        trainer.measured[0].answered(peer, "forward", 0.1)
    picks = Counter(trainer.pick(0, None) for _ in range(400))
    assert picks == {"a": 100, "b": 300}


def test_an_untried_server_counts_as_the_lower_median():
    trainer = _trainer("wrr", (("a", 1.0), ("b", 3.0), ("new", 1000.0)))
    trainer.measured[0].answered("a", "forward", 0.1)
    trainer.measured[0].answered("b", "forward", 0.1)
    assert Counter(trainer.pick(0, None) for _ in range(500)) == {"a": 100, "b": 300, "new": 100}


def test_the_trainer_measures_each_server_from_its_calls_and_routes_around_a_slow_one():
    client = _FakeClient({"a": 0.002, "b": 0.002, "slow": 0.1})
    trainer = client.timing(_trainer("wrr", (("a", 1.0), ("b", 1.0), ("slow", 1.0)), client))

    async def calls() -> None:
        for i in range(6):
            for peer in ("a", "b", "slow"):
                served = await trainer.call(0, "forward", f"r{peer}{i}", [torch.zeros(1)], prefer=peer)
                assert served.peer == peer

    asyncio.run(calls())
    assert client.calls == {"a": 6, "b": 6, "slow": 6}
    measured = trainer.measured[0]
    assert measured.latency("slow") > 4 * max(measured.latency("a"), measured.latency("b"))
    picks = Counter(trainer.pick(0, None) for _ in range(300))
    assert picks["slow"] < 300 / 3 / 4, picks  # from a third of the picks
    assert abs(picks["a"] - picks["b"]) <= 1, picks


def test_a_server_that_answered_then_times_out_loses_its_weight():
    """It announces 10^6 (credited 4 x 1), answers once, then times out: each timeout counts as the call's
    whole timeout, it is banned (as before), and once the ban is over it gets a small share."""
    client = _FakeClient({"honest": 0.002, "liar": 0.002})
    trainer = client.timing(_trainer("wrr", (("honest", 1.0), ("liar", 1e6)), client, "trainer.ban_seconds=0.0"))
    answered: list[float] = []  # the liar's figure after its one answer (about 1: as fast as the stage)

    async def calls() -> None:
        for i in range(4):
            await trainer.call(0, "forward", f"h{i}", [torch.zeros(1)], prefer="honest")
        await trainer.call(0, "forward", "l0", [torch.zeros(1)], prefer="liar")
        answered.append(trainer.measured[0].latency("liar"))
        client.failing.add("liar")
        served = await trainer.call(0, "forward", "l1", [torch.zeros(1)], prefer="liar")
        assert served.peer == "honest"

    asyncio.run(calls())
    assert client.calls["liar"] >= 2 and trainer.retries >= 1
    # a 5 s timeout against calls of a few ms counts as the most one call may: MAX_LATENCY_RATIO typical ones
    (before,) = answered
    assert trainer.measured[0].latency("liar") == pytest.approx(before + LATENCY_ALPHA * (MAX_LATENCY_RATIO - before))
    picks = Counter(trainer.pick(0, None) for _ in range(100))
    assert 10 <= picks["liar"] <= 20, picks  # 4 / (4 x 4.75) against 1: from 80% of the picks to a sixth


@pytest.mark.parametrize("routing", ["random", "wrr"])
def test_preferred_and_banned_servers(routing):
    trainer = _trainer(routing)
    assert all(trainer.pick(0, "a") == "a" for _ in range(20))  # the backward goes where the forward ran
    trainer.bans.ban("b", now=float("inf"))  # banned for good, whatever the clock says
    assert {trainer.pick(0, None) for _ in range(50)} == {"a"}
    trainer.bans.ban("a", now=float("inf"))
    assert trainer.pick(0, None) is None


@pytest.mark.parametrize("failure", ["forward timeout", "backward timeout", "broken connection"])
def test_a_backward_still_goes_to_a_server_banned_only_for_a_forwards_timeout(failure):
    """A forward that timed out behind a slow server's queue bans it from new work, yet the backwards of
    the forwards it ran still go to it (it keeps their graphs, and serves backwards first); a backward's
    timeout or a broken connection sends them elsewhere, to be recomputed."""
    trainer = _trainer("random")
    method = failure.split()[0] if "timeout" in failure else "forward"
    call = trainer._stage_call(0, method, "r", False, "a", 1)
    trainer._fault(0, method, "a", call, waited=1.0, timed_out="timeout" in failure)
    assert trainer.bans.is_banned("a", time.monotonic())
    assert {trainer.pick(0, None) for _ in range(20)} == {"b"}  # no new work for it
    expected = {"a"} if failure == "forward timeout" else {"b"}
    assert {trainer.pick(0, "a") for _ in range(20)} == expected


def test_the_epoch_callers_expect_and_the_run_s_progress_ignore_a_lying_record():
    """A record at epoch 10^9 beside honest replicas at 53: calls still carry 53 (else every honest
    replica would refuse them as stale), and the run is not taken for finished. A replica a step or two
    ahead of the others still sets the epoch (its peers are catching up)."""
    cfg = load_config(overrides=["model.num_stages=2"])
    view = SwarmView(2, config_hash(cfg), agreed(cfg), 1.0)

    def stage(*epochs: int) -> list[ServerRecord]:
        return [ServerRecord(f"p{i}", 0, 1.0, 0, e, 0, config_hash(cfg), {}) for i, e in enumerate(epochs)]

    view.servers[0] = stage(53, 10**9)
    assert view.live_epoch(0) == 53 and view.settled_epoch(0) == 53
    view.servers[0] = stage(53, 53, 10**9)
    assert view.live_epoch(0) == 53 and view.settled_epoch(0) == 53
    assert view.live_epoch(0, ignore={"p0", "p1"}) == 10**9  # alone, it cannot be told from the truth
    view.servers[0] = stage(53, 55)
    assert view.live_epoch(0) == 55 and view.settled_epoch(0) == 53
    view.servers[0], view.stage_epoch[0] = [], 70
    assert view.live_epoch(0) == 0 and view.settled_epoch(0) == 70  # no live replica: where it was last seen


def test_a_calls_timeout_counts_the_requests_queued_ahead_of_it():
    """A call behind k requests at its server may wait k + 1 times a call's measured latency bound (ours in
    flight there, or the queue it announced, whichever is longer), never beyond request_timeout. A forward
    also waits for the backwards the server owes us, which go first there; a backward does not."""
    trainer = _trainer("wrr", (("a", 1.0), ("b", 1.0)), None, "trainer.min_request_timeout=2.0",
                       "trainer.request_timeout=30.0")
    alone = trainer._stage_call(0, "forward", "r", False, "a", 1).timeout
    assert alone == 30.0  # nothing measured yet: the ceiling
    for _ in range(20):
        trainer.latency[0, "forward"].observe(0.1)
    assert trainer._stage_call(0, "forward", "r", False, "a", 1).timeout == 2.0  # the floor
    trainer.inflight["a"] = 3
    assert trainer._stage_call(0, "forward", "r", False, "a", 1).timeout == 8.0
    for _ in range(2):
        trainer.owe("a")
        trainer.latency[0, "backward"].observe(0.1)
    assert trainer._stage_call(0, "forward", "r", False, "a", 1).timeout == 12.0
    assert trainer._stage_call(0, "backward", "r", True, "a", 1).timeout == 8.0
    trainer.repay("a")
    trainer.repay("a")
    trainer.view.servers[0][1] = replace(trainer.view.servers[0][1], queue=5)
    assert trainer._stage_call(0, "forward", "r", False, "b", 1).timeout == 12.0
    trainer.inflight["a"] = 40
    assert trainer._stage_call(0, "forward", "r", False, "a", 1).timeout == 30.0


def test_a_server_measured_slower_than_the_stages_typical_one_gets_as_much_longer_to_answer():
    """The measured latency is the stage's, its fast and slow replicas together: a replica whose calls take
    three times the fast one's, about half again as long as the stage's typical call, gets about half again
    the bound; the fast one gets the bound itself, not less."""
    trainer = _trainer("wrr", (("fast", 1.0), ("slow", 1.0)), None, "trainer.min_request_timeout=2.0",
                       "trainer.request_timeout=30.0")
    for _ in range(20):
        trainer.latency[0, "forward"].observe(0.1)
        trainer.measured[0].answered("fast", "forward", 0.1)
        trainer.measured[0].answered("slow", "forward", 0.3)
    fast, slow = (trainer._stage_call(0, "forward", "r", False, peer, 1).timeout for peer in ("fast", "slow"))
    assert fast == 2.0  # the floor
    assert slow == pytest.approx(2.0 * trainer.measured[0].latency("slow")) and slow > 2.0 * 1.4


def test_backwards_owed_to_a_server_count_in_its_load_until_they_are_sent():
    """A server that ran forwards still owes their backwards (it keeps the graphs): routing weighs it as
    loaded by them, as by calls outstanding there, until each backward is sent."""
    trainer = _trainer("wrr", (("a", 1.0), ("b", 1.0)))
    for peer in ("a", "b"):
        trainer.measured[0].answered(peer, "forward", 0.1)
    assert Counter(trainer.pick(0, None) for _ in range(100)) == {"a": 50, "b": 50}
    for _ in range(3):
        trainer.owe("a")
    assert Counter(trainer.pick(0, None) for _ in range(100)) == {"a": 20, "b": 80}  # 1/4 against 1
    for _ in range(3):
        trainer.repay("a")
    assert trainer.owed == {}
    assert Counter(trainer.pick(0, None) for _ in range(100)) == {"a": 50, "b": 50}


def test_a_server_is_measured_per_request_it_served_not_per_call():
    """Routing keeps a fast server busy, so its calls wait behind ours: five times as long with four of
    ours ahead, as long as a server five times slower takes idle. It must not read as slow for that."""
    client = _FakeClient({"busy": 0.05, "idle": 0.01, "slow": 0.05})
    trainer = client.timing(_trainer("wrr", (("busy", 1.0), ("idle", 1.0), ("slow", 1.0)), client))

    async def calls() -> None:
        for i in range(8):
            for peer in ("busy", "idle", "slow"):
                trainer.inflight["busy"] = 4 if peer == "busy" else 0  # four of ours ahead of it
                await trainer.call(0, "forward", f"r{peer}{i}", [torch.zeros(1)], prefer=peer)

    asyncio.run(calls())
    measured = trainer.measured[0]
    assert measured.latency("busy") == pytest.approx(measured.latency("idle"), rel=0.5)
    assert measured.latency("slow") > 3 * measured.latency("busy")


class _Directory:
    """Lists `listed` as stage 0's servers at DHT time `clock`, each record expiring 6 s after it was read."""

    def __init__(self, listed: list[ServerRecord]):
        self.listed, self.clock = listed, 100.0
        self.expires: dict[str, float] = {}

    def now(self) -> float:
        return self.clock

    async def stages(self, num_stages):
        self.expires.update((r.peer_id, self.clock + 6.0) for r in self.listed)
        return {0: list(self.listed)}


def test_a_server_that_stopped_renewing_is_gone_after_one_view_read_past_its_records_expiry():
    """A frozen server's record expires: the first view whose read began after that and misses it makes
    the server gone. One that still renews stays through a view that misses it (a partial DHT read), and
    calls waiting on a server wake the view just after its record expires."""
    cfg = load_config(overrides=["model.num_stages=1"])
    frozen, renewing = (ServerRecord(p, 0, 1.0, 0, 0, 0, config_hash(cfg), {}) for p in ("frozen", "renewing"))
    view, directory = SwarmView(1, config_hash(cfg), agreed(cfg), 1.0), _Directory([frozen, renewing])
    asyncio.run(view.refresh(directory))  # both expire at 106
    assert until_next_view(1.0, directory, {"frozen"}) == 1.0
    directory.listed = [renewing]
    directory.clock = 103.0
    asyncio.run(view.refresh(directory))  # renewed: expires at 109
    assert not view.gone(0, "frozen")
    directory.clock = 105.5
    assert until_next_view(1.0, directory, {"frozen"}) == pytest.approx(0.5 + LAPSE_MARGIN)
    assert until_next_view(1.0, directory, {"renewing"}) == 1.0
    directory.clock = 106.0 + LAPSE_MARGIN
    directory.listed = []  # a partial read: the renewing server missing too
    asyncio.run(view.refresh(directory))
    assert view.gone(0, "frozen")
    assert not view.gone(0, "renewing")
    directory.listed = [frozen, renewing]  # the frozen one is back (thawed, and renewing again)
    asyncio.run(view.refresh(directory))
    assert not view.gone(0, "frozen")


def test_a_holder_stays_alive_while_views_stall_and_is_taken_for_gone_only_once_views_miss_it(monkeypatch):
    """Seen lately: in a view of the last three announcement periods, or in one of the last three views.
    Views that stall (a DHT lookup waiting on an unreachable node) must not make every server look dead:
    its gradients would be replayed elsewhere while it still holds them."""
    cfg = load_config(overrides=["model.num_stages=1"])
    clock = [100.0]
    monkeypatch.setattr("swarm.trainer.view.time.monotonic", lambda: clock[0])
    record = ServerRecord("holder", 0, 1.0, 0, 0, 0, config_hash(cfg), {})

    view, directory = SwarmView(1, config_hash(cfg), agreed(cfg), 1.0), _Directory([record])
    asyncio.run(view.refresh(directory))
    clock[0] += 30.0  # no view for 30 s
    assert view.seen_lately(0, "holder")
    directory.listed = []
    for _ in range(2):  # the last three views still include the one that listed it
        asyncio.run(view.refresh(directory))
        assert view.seen_lately(0, "holder")
    asyncio.run(view.refresh(directory))
    assert not view.seen_lately(0, "holder")


def test_a_server_that_never_answered_gets_one_call_at_a_time_until_it_answers():
    """A trainer's first burst: a slow server announcing the most gets one call, and the rest wait for
    the first answer (the fast server's, soon) rather than queue there; once it has answered, it gets
    calls by its measured figure."""
    answered: set[str] = set()
    before_first_answer: Counter = Counter()  # most calls in flight at a server before it answered
    inflight: Counter = Counter()

    class Tracking(_FakeClient):
        async def call(self, peer, method, meta, tensors, timeout, unpack=True):
            inflight[peer] += 1
            if peer not in answered:
                before_first_answer[peer] = max(before_first_answer[peer], inflight[peer])
            try:
                return await super().call(peer, method, meta, tensors, timeout, unpack)
            finally:
                inflight[peer] -= 1
                answered.add(peer)

    client = Tracking({"fast": 0.01, "slow": 0.5})
    trainer = _trainer("random", (("fast", 1.0), ("slow", 3.0)), client)

    async def burst() -> list[str]:
        served = await asyncio.gather(*(trainer.call(0, "forward", f"r{i}", [torch.zeros(1)]) for i in range(12)))
        return [s.peer for s in served]

    peers = asyncio.run(burst())
    assert before_first_answer == {"fast": 1, "slow": 1}
    assert Counter(peers)["slow"] <= 2 and trainer.retries == 0  # the others went to the fast server meanwhile


def test_servers_awaiting_a_first_answer_are_passed_over():
    candidates = [Candidate("new", 5.0, inflight=1), Candidate("idle new", 5.0),
                  Candidate("answered", 1.0, inflight=3, latency=1.0)]
    assert awaiting_first_answer(candidates) == {"new"}
    assert awaiting_first_answer(candidates, limit=2) == set()


def test_a_backward_leaves_its_inputs_out_only_for_the_server_that_ran_its_forward():
    """That server keeps them. Where it says it no longer does, the call goes again at once to it, with them:
    no ban, no retry counted. A backward another server takes carries them, since that one recomputes."""

    class Recording(_FakeClient):
        def __init__(self) -> None:
            super().__init__({"a": 0.0, "b": 0.0})
            self.sent: list[tuple[str, int]] = []  # (server, tensors carried)
            self.dropped: set[str] = set()  # servers that no longer hold the inputs

        async def call(self, peer, method, meta, tensors, timeout, unpack=True):
            self.sent.append((peer, len(tensors)))
            if method == "backward" and len(tensors) == 1 and peer in self.dropped:
                raise CallFailed("the inputs of its forward are no longer held here", answered=True, with_inputs=True)
            return await super().call(peer, method, meta, tensors, timeout, unpack)

    client = Recording()
    trainer = _trainer("wrr", (("a", 1.0), ("b", 1.0)), client)
    x, dy = torch.zeros(2, 3), torch.ones(2, 3)

    async def calls() -> None:
        assert (await trainer.call(0, "backward", "r1", [x, dy], prefer="a", accumulating=True)).peer == "a"
        client.dropped.add("a")
        assert (await trainer.call(0, "backward", "r2", [x, dy], prefer="a", accumulating=True)).peer == "a"
        await trainer.call(0, "backward", "r3", [x, dy], prefer="gone", accumulating=True)
        await trainer.call(0, "forward", "r4", [x], prefer="a")

    asyncio.run(calls())
    assert client.sent[:3] == [("a", 1), ("a", 1), ("a", 2)]
    assert client.sent[3][1] == 2 and client.sent[4] == ("a", 1)
    assert trainer.inputs_resent == 1 and trainer.retries == 0 and not trainer.bans.is_banned("a", time.monotonic())
