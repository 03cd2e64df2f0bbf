"""The stage all-reduce, with every member in one event loop: results are the exact mean on every
member, late owners are woken by contributions, and any disagreement fails the round everywhere."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.averaging import patience
from swarm.averaging.allreduce import StageAllReduce
from swarm.averaging.checks import POISON, Bounds
from swarm.averaging.failures import RoundFailed
from swarm.averaging.patience import ROUND_CEILING
from swarm.averaging.rounds import RoundResult, part_bounds
from swarm.core.ledger import merge_ids
from swarm.net.identity import peer_id_of
from swarm.net.protocol import decode, encode
from swarm.net.receipts import sign_receipt
from swarm.net.transport import CallFailed
from swarm.wire import codecs
from swarm.wire.codecs import EXACT, Policy, error_bound
from swarm.wire.validate import BadRequest

SHORT = 1.0  # seconds a round may take in tests that expect it to fail
MARGIN = 5.0  # outer deadline: a hang fails the test instead of stalling the suite


async def _through_wire(meta: dict[str, Any], items: Sequence[Any], policy: Policy) -> tuple[dict, list]:
    """What the other side reads: the call's metadata and tensors framed and packed as the transport does."""
    async def stream() -> AsyncIterator[Any]:
        for message in encode(meta, items, policy):
            yield message

    return await decode(stream(), 1 << 40)


class LoopbackClient:
    """Delivers `reduce` calls to the owner's `contribute` as the transport would: the tensors travel
    framed and packed by `policy`, a refusal comes back as CallFailed(refused=True), and the call has
    a deadline."""

    def __init__(self, own_id: str, members: dict[str, StageAllReduce], policy: Policy):
        self.own_id = own_id
        self.members = members
        self.policy = policy
        self.calls: list[tuple[str, str]] = []
        self.lose_reply_from: set[str] = set()  # owners whose next reply is lost after they answered
        self.dead: set[str] = set()  # owners every call to fails at once, as to a killed process
        self.stalled: set[str] = set()  # owners no call reaches: each waits until its caller gives it up

    async def call(
        self, peer_id: str, method: str, meta: dict[str, Any], tensors: Sequence[torch.Tensor], timeout: float
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        assert method == "reduce"
        self.calls.append((self.own_id, peer_id))
        if peer_id in self.dead:
            raise CallFailed(f"{method} failed: dial backoff")
        if peer_id in self.stalled:
            await asyncio.Event().wait()
        owner = self.members[peer_id]
        try:
            meta, received = await _through_wire(meta, tensors, self.policy)
            reply, out = await asyncio.wait_for(owner.contribute(meta, received, self.own_id), timeout)
        except TimeoutError as e:
            raise CallFailed(f"{method} timed out after {timeout:.1f}s") from e
        except BadRequest as e:
            raise CallFailed(str(e), refused=True) from e
        if peer_id in self.lose_reply_from:
            self.lose_reply_from.discard(peer_id)
            raise CallFailed(f"{method} failed: connection reset")
        return await _through_wire(reply, out, self.policy)


Wake = Callable[[int, tuple[str, ...]], Awaitable[bool]]  # an owner woken by a round it has not begun


async def always(epoch: int, group: tuple[str, ...]) -> bool:
    return True


def make_members(
    ids: Sequence[str], timeout: float = 5.0, on_wake: dict[str, Wake] | None = None,
    policy: Policy = EXACT, bounds: Bounds | None = None,
) -> dict[str, StageAllReduce]:
    members: dict[str, StageAllReduce] = {}
    for peer in ids:
        wake = (on_wake or {}).get(peer, always)
        members[peer] = StageAllReduce(LoopbackClient(peer, members, policy), peer, stage=1, timeout=timeout,
                                       on_wake=wake, bounds=bounds or Bounds())
    return members


def grads(sizes: dict[str, int], numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {peer: torch.randn(numel, generator=gen) * (n + 1) for peer, n in sizes.items()}


def run_all(coro: Coroutine[Any, Any, Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, MARGIN)

    return asyncio.run(bounded())


def assert_exact_mean(
    results: Sequence[RoundResult], flat: dict[str, torch.Tensor], samples: dict[str, int]
) -> None:
    total = sum(samples.values())
    expected = torch.stack(list(flat.values())).sum(0) / total
    first = results[0].mean
    for result in results:
        assert result.samples == total
        assert result.mean.dtype == torch.float32 and result.mean.shape == expected.shape
        assert torch.equal(result.mean, first)  # the same bits on every member
    torch.testing.assert_close(first, expected, rtol=1e-6, atol=1e-7)


# ---- the round -------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1001, 2])
def test_every_member_gets_the_same_exact_mean(numel: int) -> None:
    """Uneven sample counts weigh each replica correctly; sizes not divisible by the group (and smaller
    than it, giving empty parts) still come back whole."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 3, "peerB": 5, "peerC": 8}
    flat = grads(samples, numel)
    members = make_members(ids)

    async def main() -> list[RoundResult]:
        return await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids))

    results = run_all(main())
    assert_exact_mean(results, flat, samples)
    for peer in ids:  # every member sent one part to each other owner
        assert sorted(members[peer].client.calls) == sorted((peer, o) for o in ids if o != peer)
        assert members[peer]._rounds == {} and members[peer]._started == {}


@pytest.mark.parametrize("codec", ["fp16", "blockwise8", "uint8"])
def test_a_lossy_codec_gives_every_member_the_same_bits(codec: str) -> None:
    """Parts travel packed: the mean is only as exact as the codec, but each owner's packing is decoded
    alike by every member, itself included, so the replicas still step to the same weights."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 3, "peerB": 5, "peerC": 8}
    flat = grads(samples, 3001, seed=4)
    members = make_members(ids, policy=Policy({"allreduce": codec}))

    async def main() -> list[RoundResult]:
        return await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids))

    results = run_all(main())
    assert all(torch.equal(r.mean, results[0].mean) for r in results)
    exact = torch.stack(list(flat.values())).sum(0) / sum(samples.values())
    assert not torch.equal(results[0].mean, exact)  # the codec did act
    # contributions and the mean were each packed once: twice the codec's bound on the mean's scale
    # (each member's part, weighted by its share, is at most its own bound)
    bound = sum(error_bound(g, codec) for g in flat.values()) / sum(samples.values()) + error_bound(exact, codec)
    assert bool(((results[0].mean - exact).abs() <= bound * 1.01 + 1e-7).all())


def test_every_member_records_the_union_of_microbatch_ids(caplog: pytest.LogCaptureFixture) -> None:
    """Each member lists the microbatches its gradient holds; all members learn the same stage-wide
    list, and an id listed by two members (accumulated twice) is reported."""
    ids = ("peerA", "peerB", "peerC")
    held = {"peerA": ["t/1", "t/4"], "peerB": ["t/2"], "peerC": ["t/3", "t/1"]}
    flat = grads(dict.fromkeys(ids, 1), 50)
    members = make_members(ids)

    async def main() -> list[RoundResult]:
        return await asyncio.gather(*(members[p].run(5, ids, flat[p], 1, ids=held[p]) for p in ids))

    with caplog.at_level(logging.ERROR):
        results = run_all(main())
    assert all(r.ids == ["t/1", "t/2", "t/3", "t/4"] for r in results)
    assert "accumulated by two replicas: t/1" in caplog.text
    assert merge_ids([["b", "a"], ["c"]]) == (["a", "b", "c"], [])


def test_a_lost_reply_is_recovered_by_calling_again() -> None:
    """The owner took the part but its reply was lost: the member calls again and receives the round's
    result (the owner has already finished), so the round still completes with the exact mean."""
    ids = ("peerA", "peerB")
    samples = {"peerA": 3, "peerB": 1}
    flat = grads(samples, 101, seed=3)
    members = make_members(ids)
    members["peerA"].client.lose_reply_from.add("peerB")

    async def main() -> list[RoundResult]:
        return await asyncio.gather(*(members[p].run(2, ids, flat[p], samples[p]) for p in ids))

    results = run_all(main())
    assert members["peerA"].client.calls == [("peerA", "peerB")] * 2
    assert_exact_mean(results, flat, samples)


def test_an_owner_answers_a_repeated_part_with_its_result_and_refuses_another_part_of_the_same_member() -> None:
    """A member that retries sends the part of its failed attempt again; an owner whose round already
    reduced that part answers with its result. A different part (a retry that took in what accumulated
    since) is refused: answering it with the old result while other owners reduce the new part made the
    owners' totals disagree in every retry, for as long as the members' retries kept mixing."""
    ids = ("peerA", "peerB")
    samples = {"peerA": 3, "peerB": 1}
    flat = grads(samples, 10, seed=5)
    members = make_members(ids)

    async def main() -> tuple[list[RoundResult], tuple[dict, list]]:
        results = await asyncio.gather(*(members[p].run(4, ids, flat[p], samples[p], ids=[f"{p}/1"]) for p in ids))
        part = flat["peerB"][:5]
        repeat = await members["peerA"].contribute(_meta(epoch=4, samples=1, ids=["peerB/1"]), [part], "peerB")
        with pytest.raises(BadRequest, match="reduced with another part of …peerB's \\(1 samples, not 5\\)"):
            await members["peerA"].contribute(_meta(epoch=4, samples=5, ids=["peerB/1", "peerB/2"]), [part * 5],
                                              "peerB")
        return results, repeat

    results, (reply, (answer,)) = run_all(main())
    assert_exact_mean(results, flat, samples)
    assert reply == {"samples": 4, "ids": ["peerA/1", "peerB/1"]}
    assert torch.equal(codecs.decode(answer.value), results[0].mean[:5])


def test_gradients_are_not_modified_in_place() -> None:
    ids = ("peerA", "peerB")
    samples = {"peerA": 1, "peerB": 2}
    flat = grads(samples, 10)
    kept = {p: g.clone() for p, g in flat.items()}
    members = make_members(ids)

    async def main() -> list[RoundResult]:
        return await asyncio.gather(*(members[p].run(4, ids, flat[p], samples[p]) for p in ids))

    run_all(main())
    for peer in ids:
        assert torch.equal(flat[peer], kept[peer])


def test_a_member_outside_its_own_group_is_refused() -> None:
    members = make_members(["peerA", "peerB"])
    with pytest.raises(ValueError, match="own group"):
        run_all(members["peerA"].run(0, ("peerB", "peerC"), torch.zeros(4), 1))


@pytest.mark.parametrize(("total", "parts"), [(1001, 3), (12, 4), (7, 1), (2, 3), (0, 2), (100, 7)])
def test_part_bounds_cover_the_vector_in_near_equal_slices(total: int, parts: int) -> None:
    bounds = part_bounds(total, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False):
        assert stop == start  # contiguous: no gap, no overlap
    sizes = [stop - start for start, stop in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == total


# ---- waking a late owner ---------------------------------------------------------------------------


def test_a_contribution_wakes_an_owner_that_has_not_begun() -> None:
    """peerB starts its round only when a contribution reaches it and its on_wake joins the proposed
    group; the round then completes for all three."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 2, "peerB": 7, "peerC": 4}
    flat = grads(samples, 1001, seed=1)
    woken: list[tuple[int, tuple[str, ...]]] = []
    late: list[asyncio.Task] = []

    async def wake_b(epoch: int, group: tuple[str, ...]) -> bool:
        woken.append((epoch, group))
        if not late:  # a second early contribution must not start a second round
            late.append(asyncio.create_task(members["peerB"].run(epoch, group, flat["peerB"], samples["peerB"])))
        return True

    members = make_members(ids, on_wake={"peerB": wake_b})

    async def main() -> list[RoundResult]:
        early = await asyncio.gather(*(members[p].run(9, ids, flat[p], samples[p]) for p in ("peerA", "peerC")))
        assert len(late) == 1
        return [*early, await late[0]]

    results = run_all(main())
    assert woken and set(woken) == {(9, ids)}
    assert_exact_mean(results, flat, samples)


def test_owner_at_another_epoch_fails_the_senders_round() -> None:
    """on_wake returning False (the owner is not at this epoch) refuses the contribution: RoundFailed."""
    ids = ("peerA", "peerB")
    woken: list[tuple[int, tuple[str, ...]]] = []

    async def elsewhere(epoch: int, group: tuple[str, ...]) -> bool:
        woken.append((epoch, group))
        return False

    members = make_members(ids, timeout=SHORT, on_wake={"peerB": elsewhere})
    with pytest.raises(RoundFailed, match="epoch 3") as info:
        run_all(members["peerA"].run(3, ids, torch.randn(11), 2))
    assert woken == [(3, ids)]
    assert isinstance(info.value.__cause__, CallFailed) and info.value.__cause__.refused
    assert "not at epoch 3" in str(info.value)
    assert members["peerA"]._rounds == {}


def test_woken_owner_that_never_begins_refuses_after_the_timeout() -> None:
    """on_wake says yes but no round starts here: the contribution is refused once `timeout` passes,
    and the sender's round fails."""
    ids = ("peerA", "peerB")
    woken: list[tuple[int, tuple[str, ...]]] = []

    async def agree(epoch: int, group: tuple[str, ...]) -> bool:
        woken.append((epoch, group))
        return True

    members = make_members(ids, timeout=SHORT, on_wake={"peerB": agree})
    meta = {"epoch": 2, "group": list(ids), "samples": 1, "stage": 1}
    with pytest.raises(BadRequest, match="no round for epoch 2 began here"):
        run_all(members["peerB"].contribute(meta, [torch.zeros(5)], "peerA"))
    assert woken == [(2, ids)]
    assert members["peerB"]._started == {}

    with pytest.raises(RoundFailed):
        run_all(members["peerA"].run(2, ids, torch.randn(11), 2))


# ---- disagreement and absence --------------------------------------------------------------------


def test_group_mismatch_fails_every_member() -> None:
    """peerC believes peerB is not in the group: owners refuse each other's contributions."""
    views = {"peerA": ("peerA", "peerB", "peerC"), "peerB": ("peerA", "peerB", "peerC"), "peerC": ("peerA", "peerC")}
    samples = {"peerA": 1, "peerB": 1, "peerC": 1}
    flat = grads(samples, 30)
    members = make_members(list(views), timeout=SHORT)

    async def main() -> list[Any]:
        runs = (members[p].run(0, views[p], flat[p], samples[p]) for p in views)
        return await asyncio.gather(*runs, return_exceptions=True)

    outcomes = run_all(main())
    assert all(isinstance(o, RoundFailed) for o in outcomes), outcomes
    assert any("group mismatch" in str(o) for o in outcomes)


def test_absent_member_fails_the_others_within_the_timeout() -> None:
    """peerC is in everyone's group but never runs: the others give up after `timeout`, not later."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 1, "peerB": 2}
    flat = grads(samples, 100)
    members = make_members(ids, timeout=SHORT)

    async def main() -> tuple[list[Any], float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        outcomes = await asyncio.gather(
            *(members[p].run(0, ids, flat[p], samples[p]) for p in samples), return_exceptions=True
        )
        return outcomes, loop.time() - start

    outcomes, elapsed = run_all(main())
    assert all(isinstance(o, RoundFailed) for o in outcomes), outcomes
    assert elapsed < SHORT + 1.0
    assert all(o.unreachable == frozenset({"peerC"}) for o in outcomes)  # the one that sent nothing
    for peer in samples:
        assert members[peer]._rounds == {}


class _LateClient(LoopbackClient):
    """A member whose parts reach their owners `delay` seconds late: a slow machine, a slow link."""

    delay = 0.0

    async def call(self, peer_id, method, meta, tensors, timeout):
        await asyncio.sleep(self.delay)
        return await super().call(peer_id, method, meta, tensors, timeout)


def test_a_round_waits_as_long_as_this_members_rounds_have_been_taking() -> None:
    """peerB's parts come 0.8 s late, round after round: its groupmates' rounds take that long, and then
    a part 1.3 s late, beyond `net.allreduce_timeout` (1 s), is still waited for instead of the round
    being given up and peerB left out of the next groups. A member that died would cost at most 4 s."""
    ids = ("peerA", "peerB")
    samples = {"peerA": 1, "peerB": 2}
    members = make_members(ids, timeout=SHORT)
    late = members["peerB"].client = _LateClient("peerB", members, EXACT)
    assert all(m.patience.timeout == SHORT for m in members.values())  # before any round was timed: the floor

    async def round_(epoch: int, delay: float) -> list[RoundResult]:
        late.delay = delay
        flat = grads(samples, 100, seed=epoch)
        return await asyncio.gather(*(members[p].run(epoch, ids, flat[p], samples[p]) for p in ids))

    async def main() -> list[RoundResult]:
        for epoch in range(3):
            await round_(epoch, 0.8)
        assert all(SHORT + 0.5 < m.patience.timeout < 4 * SHORT for m in members.values())
        return await round_(3, 1.3)

    results = asyncio.run(main())
    assert_exact_mean(results, grads(samples, 100, seed=3), samples)


def records_showing(live: set[str]) -> Callable[[int, frozenset[str]], Awaitable[frozenset[str]]]:
    """A stage's records as a read finds them: `live` renew theirs at every epoch."""
    async def at_epoch(epoch: int, members: frozenset[str]) -> frozenset[str]:
        return members & live
    return at_epoch


def test_a_first_round_waits_past_the_timeout_for_a_late_member_its_records_show_alive() -> None:
    """peerB's part comes 0.5 s past the timeout in the first round (nothing timed yet): while the stage's
    records show it live at the round's epoch, peerA waits and both step; once they no longer do (it died),
    peerA gives up at the next read. After a completed round the learned timeout decides alone."""
    ids = ("peerA", "peerB")
    samples = {"peerA": 1, "peerB": 2}
    flat = grads(samples, 100)
    members = make_members(ids, timeout=SHORT)
    live = {"peerB"}
    members["peerA"].patience.at_epoch = records_showing(live)
    late = members["peerB"].client = _LateClient("peerB", members, EXACT)
    late.delay = SHORT + 0.5

    async def round_(epoch: int) -> tuple[list[Any], float]:
        """Both members' outcomes, and how long peerA's took."""
        start = asyncio.get_running_loop().time()
        a = asyncio.ensure_future(members["peerA"].run(epoch, ids, flat["peerA"], samples["peerA"]))
        a.add_done_callback(lambda _: took.append(asyncio.get_running_loop().time() - start))
        b = members["peerB"].run(epoch, ids, flat["peerB"], samples["peerB"])
        took: list[float] = []
        return await asyncio.gather(a, b, return_exceptions=True), took

    results, (took,) = run_all(round_(0))
    assert_exact_mean(results, flat, samples)
    assert took >= SHORT + 0.5

    fresh = make_members(ids, timeout=SHORT)  # the same, at servers that never completed a round
    fresh["peerA"].patience.at_epoch = records_showing(live)
    members.update(fresh)
    late = members["peerB"].client = _LateClient("peerB", members, EXACT)
    late.delay = 60.0
    live.clear()  # its record lapsed: dead, not late

    (a, _), (took,) = run_all(round_(1))
    assert isinstance(a, RoundFailed) and a.unreachable == frozenset({"peerB"}), a
    assert took < SHORT + 1.0, took  # at the timeout, not the ceiling


def test_after_a_completed_round_a_late_member_is_not_waited_for_past_the_learned_timeout() -> None:
    """The records' say counts only while the timeout is the floor: a timed round knows how slow the group
    is, and a hostile member alive in the records holds no round past it."""
    ids = ("peerA", "peerB")
    samples = {"peerA": 1, "peerB": 2}
    flat = grads(samples, 100)
    members = make_members(ids, timeout=SHORT)
    members["peerA"].patience.at_epoch = records_showing({"peerB"})
    late = members["peerB"].client = _LateClient("peerB", members, EXACT)

    async def round_(epoch: int) -> list[Any]:
        return await asyncio.gather(*(members[p].run(epoch, ids, flat[p], samples[p]) for p in ids),
                                    return_exceptions=True)

    assert_exact_mean(run_all(round_(0)), flat, samples)
    learned = members["peerA"].patience.timeout
    late.delay = learned + 2.0
    a, _ = run_all(round_(1))
    assert isinstance(a, RoundFailed) and a.unreachable == frozenset({"peerB"}), a


def test_a_member_gone_from_the_stages_records_ends_the_round_long_before_its_timeout(monkeypatch) -> None:
    """peerB froze before its round began: its part never comes, calls to it hang, and its record lapses.
    peerA, whose reads of the records show that twice in a row, gives up then instead of at its 30 s
    timeout, naming peerB; peerC, whose part waited at peerA, hears why from peerA and names peerB too.
    Both leave it out of their next group, and meanwhile their gradients do not wait unstepped."""
    monkeypatch.setattr(patience, "RECHECK", 0.2)
    monkeypatch.setattr(patience, "CONFIRM", 0.1)
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 1, "peerB": 2, "peerC": 3}
    flat = grads(samples, 90)
    members = make_members(ids, timeout=30.0)
    asked: list[frozenset[str]] = []

    async def lapsed(waiting: frozenset[str]) -> frozenset[str]:
        asked.append(waiting)
        return waiting & {"peerB"}

    members["peerA"].patience.lapsed = lapsed

    async def main() -> tuple[list[Any], float]:
        start = time.monotonic()
        outcomes = await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ("peerA", "peerC")),
                                        return_exceptions=True)
        return outcomes, time.monotonic() - start

    (a, c), took = run_all(main())
    assert isinstance(a, RoundFailed) and a.unreachable == {"peerB"}, a
    assert isinstance(c, RoundFailed) and c.unreachable == {"peerB"}, c
    assert took < 2.0, took
    assert asked and all("peerB" in waiting and "peerA" not in waiting for waiting in asked), asked


def test_a_member_missed_by_one_read_of_the_records_is_waited_for_as_before(monkeypatch) -> None:
    """The same check, with peerB slow but renewing its record: one read misses it (a partial read, or a
    renewal late on a busy machine), the next lists it again, so its part, 0.6 s late, is waited for and
    the round completes."""
    monkeypatch.setattr(patience, "RECHECK", 0.2)
    monkeypatch.setattr(patience, "CONFIRM", 0.1)
    ids = ("peerA", "peerB")
    samples = {"peerA": 1, "peerB": 2}
    flat = grads(samples, 100)
    members = make_members(ids, timeout=SHORT)
    checks: list[frozenset[str]] = []

    async def lapsed(waiting: frozenset[str]) -> frozenset[str]:
        checks.append(waiting)
        return waiting if len(checks) == 1 else frozenset()

    members["peerA"].patience.lapsed = lapsed
    members["peerB"].client = late = _LateClient("peerB", members, EXACT)
    late.delay = 0.6

    async def main() -> list[Any]:
        return await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids))

    assert_exact_mean(run_all(main()), flat, samples)
    assert len(checks) >= 2  # the records were read again while peerB's part was late


class _SlowAnswers(LoopbackClient):
    """A member to whom owners' answers come `delay` seconds after they were given: slow owners."""

    delay = 0.0

    async def call(self, peer_id, method, meta, tensors, timeout):
        answer = await super().call(peer_id, method, meta, tensors, timeout)
        await asyncio.sleep(self.delay)
        return answer


def test_an_owner_that_sent_its_part_is_waited_for_past_the_timeout_up_to_the_ceiling() -> None:
    """peerB's part for peerA's half comes at once, but its answer for its own half comes 0.5 s past the
    round's timeout, in this member's first round (nothing timed yet): peerB is alive and in the round, and
    peerA has already answered it, so both complete instead of peerA falling a step behind. An answer that
    never comes is given up at ROUND_CEILING times the timeout."""
    ids = ("peerA", "peerB")
    samples = {"peerA": 1, "peerB": 2}
    flat = grads(samples, 100)
    members = make_members(ids, timeout=SHORT)
    slow = members["peerA"].client = _SlowAnswers("peerA", members, EXACT)
    slow.delay = SHORT + 0.5

    async def round_(epoch: int) -> list[Any]:
        return await asyncio.gather(*(members[p].run(epoch, ids, flat[p], samples[p]) for p in ids),
                                    return_exceptions=True)

    assert_exact_mean(run_all(round_(0)), flat, samples)
    slow.delay = 60.0

    async def never_answered() -> tuple[list[Any], float]:
        start = asyncio.get_running_loop().time()
        results = await round_(1)
        return results, asyncio.get_running_loop().time() - start

    (a, b), took = run_all(never_answered())
    assert isinstance(a, RoundFailed) and isinstance(b, RoundResult), (a, b)
    assert ROUND_CEILING * SHORT <= took < ROUND_CEILING * SHORT + 1.0, took


def test_an_unreachable_owner_fails_the_round_at_once_and_is_named() -> None:
    """Calls to a killed member fail fast; the round gives up after a few, well before its timeout,
    and says whom to leave out of the next group."""
    ids = ("peerA", "peerB")
    members = make_members(ids, timeout=30.0)
    members["peerA"].client.dead.add("peerB")

    async def main() -> tuple[Any, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await members["peerA"].run(0, ids, torch.randn(10), 1)
        except RoundFailed as e:
            return e, loop.time() - start
        return None, loop.time() - start

    error, elapsed = run_all(main())
    assert isinstance(error, RoundFailed) and error.unreachable == frozenset({"peerB"})
    assert elapsed < 2.0
    assert members["peerA"].client.calls.count(("peerA", "peerB")) == 3
    assert members["peerA"]._rounds == {}


@pytest.mark.parametrize("delivered", [True, False], ids=["delivered", "lost"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 3e38])
def test_a_poisoned_contribution_fails_the_round_at_once_and_names_its_sender(poison: float, delivered: bool
                                                                              ) -> None:
    """peerC's part is not finite, or its norm per sample is over the bound: every honest owner refuses it
    and ends its round before the timeout, and every honest member's failure names peerC, so the next
    group leaves it out. No mean is computed with it. Where peerC's calls never reach the others (its own
    owner refused its part first, and it gave up the calls), its refusal of their parts says that its own
    part was poison, and that word about itself names it."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 2, "peerB": 3, "peerC": 4}
    flat = grads(samples, 90)
    flat["peerC"][::7] = poison
    members = make_members(ids, timeout=30.0, bounds=Bounds(max_norm_per_sample=1e3))
    if not delivered:
        members["peerC"].client.dead = {"peerA", "peerB"}

    async def main() -> tuple[list[Any], float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        outcomes = await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids),
                                        return_exceptions=True)
        return outcomes, loop.time() - start

    outcomes, elapsed = run_all(main())
    assert all(isinstance(o, RoundFailed) for o in outcomes), outcomes
    assert elapsed < 2.0
    for peer, outcome in zip(ids, outcomes, strict=True):
        if peer != "peerC":
            assert outcome.unreachable == frozenset({"peerC"}), outcome


def test_a_member_whose_part_is_refused_as_poison_before_its_own_round_sees_it_names_itself() -> None:
    """peerB refuses peerC's part as poison before peerC's own part reaches peerC's own round, and peerC's
    part to peerA never arrives. peerC checks the refused part itself, finds it poison, and its round,
    given up, names peerC to peerA's part: peerA, told by peerB that peerC was poison, has that word from
    peerC about itself and names it at once. (Its round given up unnamed, peerC left peerA's part waiting
    for a round to begin there, and peerA waited out its whole timeout.)"""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 2, "peerB": 3, "peerC": 4}
    flat = grads(samples, 90)
    flat["peerC"][::7] = float("nan")
    members = make_members(ids, timeout=30.0, bounds=Bounds(max_norm_per_sample=1e3))
    peer_c = members["peerC"]
    peer_c.client.stalled = {"peerA"}
    refused = asyncio.Event()
    calls, contribute = peer_c.client.call, peer_c.contribute

    async def call_then_tell(peer_id, *args, **kwargs):
        try:
            return await calls(peer_id, *args, **kwargs)
        finally:
            refused.set()

    async def own_part_after_the_refusal(meta, tensors, sender):
        if sender == "peerC":
            await refused.wait()
        return await contribute(meta, tensors, sender)

    peer_c.client.call, peer_c.contribute = call_then_tell, own_part_after_the_refusal

    async def main() -> tuple[list[Any], float]:
        start = time.monotonic()
        outcomes = await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids),
                                        return_exceptions=True)
        return outcomes, time.monotonic() - start

    outcomes, elapsed = run_all(main())
    assert elapsed < 2.0
    assert all(isinstance(o, RoundFailed) and o.unreachable == frozenset({"peerC"}) for o in outcomes), outcomes


def test_an_owner_naming_a_member_as_poison_is_not_taken_at_its_word() -> None:
    """peerB gives up every part saying peerC's part was poison, though peerC is honest: peerA waits for
    peerC's part to reach its own round, finds it sound, and its failure names no one for poison."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 2, "peerB": 3, "peerC": 4}
    flat = grads(samples, 30)
    members = make_members(ids, timeout=SHORT, bounds=Bounds(max_norm_per_sample=1e3))

    async def slander(meta, tensors, sender):
        raise BadRequest("not ready: the round for epoch 0 was abandoned: poison from peerC")

    members["peerB"].contribute = slander

    async def main() -> list[Any]:
        return await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ("peerA", "peerC")),
                                    return_exceptions=True)

    outcomes = run_all(main())
    assert all(isinstance(o, RoundFailed) and "peerC" not in o.unreachable for o in outcomes), outcomes


@pytest.mark.parametrize("answer", [float("nan"), 1e30])
def test_an_owner_answering_poison_is_not_used_and_is_named(answer: float) -> None:
    """peerC owns a part and answers every member with NaN, or with a mean no bounded contributions
    could sum to: the honest members apply nothing and leave peerC out of their next groups."""
    ids = ("peerA", "peerB", "peerC")
    samples = {"peerA": 2, "peerB": 3, "peerC": 4}
    flat = grads(samples, 30)
    members = make_members(ids, bounds=Bounds(max_norm_per_sample=1e3))
    honest_contribute = members["peerC"].contribute

    async def poisoned(meta, tensors, sender):
        reply, (packed,) = await honest_contribute(meta, tensors, sender)
        return reply, [torch.full_like(codecs.decode(packed.value), answer)]

    members["peerC"].contribute = poisoned

    async def main() -> list[Any]:
        return await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids),
                                    return_exceptions=True)

    outcomes = run_all(main())
    for peer, outcome in zip(ids[:2], outcomes, strict=False):
        assert isinstance(outcome, RoundFailed) and outcome.unreachable == frozenset({"peerC"}), (peer, outcome)


def test_a_refusal_names_its_owner_unless_the_replicas_merely_disagree_on_the_round() -> None:
    """An owner not at our epoch refuses as honest replicas do while one catches up: not held against it.
    An owner refusing for any other reason is named (the step loop leaves it out after a few such)."""
    ids = ("peerA", "peerB")
    async def not_at_epoch(epoch: int, group: tuple[str, ...]) -> bool:
        return False

    not_ready = make_members(ids, timeout=SHORT, on_wake={"peerB": not_at_epoch})
    with pytest.raises(RoundFailed) as info:
        run_all(not_ready["peerA"].run(0, ids, torch.randn(10), 1))
    assert info.value.refused_by == frozenset()

    hostile = make_members(ids, timeout=SHORT)

    async def refuse(meta, tensors, sender):
        raise BadRequest("refused by a hostile server")

    hostile["peerB"].contribute = refuse
    with pytest.raises(RoundFailed) as info:
        run_all(hostile["peerA"].run(0, ids, torch.randn(10), 1))
    assert info.value.refused_by == frozenset({"peerB"})


def test_clipped_aggregation_bounds_one_hostile_members_pull() -> None:
    """Three replicas, one sending a finite gradient 100 times the others' scale (within the norm bound):
    with the plain mean it dominates the step; clipped to twice the median, it counts as an honest one."""
    ids = ("peerA", "peerB", "peerC")
    samples = dict.fromkeys(ids, 4)
    flat = grads(dict.fromkeys(ids, 0), 1000)
    flat["peerC"] = flat["peerC"] * 100
    honest = (flat["peerA"] + flat["peerB"]) / 8

    def step_with(clip: float) -> torch.Tensor:
        members = make_members(ids, bounds=Bounds(max_norm_per_sample=1e6, clip_to_median=clip))

        async def main() -> list[RoundResult]:
            return await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids))

        results = run_all(main())
        assert all(torch.equal(r.mean, results[0].mean) for r in results)  # the same bits everywhere
        return results[0].mean

    plain, clipped = step_with(0.0), step_with(2.0)
    assert float((plain - honest).norm()) > 10 * float(honest.norm())
    assert float((clipped - honest).norm()) < 1.5 * float(honest.norm())


def test_a_contribution_claiming_more_samples_than_its_microbatches_hold_is_refused() -> None:
    members = make_members(["peerA", "peerB"], timeout=SHORT, bounds=Bounds(samples_per_id=8))

    async def main() -> None:
        round_ = asyncio.create_task(members["peerA"].run(0, ("peerA", "peerB"), torch.zeros(10), 1, ids=["a"]))
        await asyncio.sleep(0)
        try:
            with pytest.raises(BadRequest, match="claims 10000 samples for 1"):
                await members["peerA"].contribute(_meta(samples=10_000, ids=["x"]), [torch.zeros(5)], "peerB")
        finally:
            round_.cancel()
            await asyncio.gather(round_, return_exceptions=True)

    run_all(main())


# ---- malformed requests --------------------------------------------------------------------------


def _meta(**overrides: Any) -> dict[str, Any]:
    return {"epoch": 0, "group": ["peerA", "peerB"], "samples": 2, "stage": 1, **overrides}


@pytest.mark.parametrize(
    ("meta", "tensors", "sender"),
    [
        ([], [torch.zeros(5)], "peerB"),
        (None, [torch.zeros(5)], "peerB"),
        ({"group": ["peerA", "peerB"], "samples": 2}, [torch.zeros(5)], "peerB"),
        (_meta(epoch="zero"), [torch.zeros(5)], "peerB"),
        (_meta(samples=None), [torch.zeros(5)], "peerB"),
        (_meta(group=5), [torch.zeros(5)], "peerB"),
        (_meta(ids=[3, 4]), [torch.zeros(5)], "peerB"),  # microbatch ids must be strings
        (_meta(), [torch.zeros(5)], "peerC"),  # sender outside the group it claims
        (_meta(), [torch.zeros(5), torch.zeros(5)], "peerB"),
        (_meta(), [], "peerB"),
        (_meta(), [torch.zeros(4)], "peerB"),  # wrong part size
        (_meta(), [torch.zeros(5, dtype=torch.float64)], "peerB"),
        (_meta(group=["peerA", "peerB", "peerC"]), [torch.zeros(5)], "peerB"),  # another group
    ],
)
def test_malformed_reduce_requests_are_refused(meta: Any, tensors: list[torch.Tensor], sender: str) -> None:
    """While peerA's round for epoch 0 (part size 5) is open, bad requests raise BadRequest only."""
    members = make_members(["peerA", "peerB"], timeout=SHORT)
    owner = members["peerA"]

    async def main() -> None:
        round_ = asyncio.create_task(owner.run(0, ("peerA", "peerB"), torch.zeros(10), 1))
        await asyncio.sleep(0)  # the round is registered before its first await
        assert 0 in owner._rounds
        try:
            with pytest.raises(BadRequest):
                await owner.contribute(meta, tensors, sender)
        finally:
            round_.cancel()
            await asyncio.gather(round_, return_exceptions=True)

    run_all(main())


# ---- receipts ------------------------------------------------------------------------------------

TRAINER = Ed25519PrivateKey.generate()
TRAINER_ID = peer_id_of(TRAINER.public_key())


def receipts(holder: str, reqs: dict[str, int]) -> tuple[list[str], list[list]]:
    """The ledger keys of a trainer's microbatches given to `holder` (stage 1), and their receipts."""
    keys = [f"{TRAINER_ID}/{r}" for r in reqs]
    return keys, [[n, sign_receipt(TRAINER, key, 1, holder, n)] for key, n in zip(keys, reqs.values(), strict=True)]


def test_microbatches_listed_with_their_receipts_are_stepped_and_forged_ones_poison_their_lister() -> None:
    """peerC lists a microbatch peerA holds, showing peerA's receipt: a receipt is bound to its holder, so
    every honest owner refuses peerC's part and names it. Without peerC, the round takes both members'
    microbatches, and their samples are the receipts' sum."""
    held = {"peerA": {"m1": 2, "m2": 3}, "peerB": {"m3": 4}}
    lists = {peer: receipts(peer, reqs) for peer, reqs in held.items()}
    stolen_keys, stolen = receipts("peerA", {"m1": 2})
    lists["peerC"] = (stolen_keys, stolen)
    samples = {"peerA": 5, "peerB": 4, "peerC": 2}
    flat = grads(samples, 30)
    group = ("peerA", "peerB", "peerC")
    members = make_members(group, timeout=30.0, bounds=Bounds(receipts=True))

    async def round_of(peers: tuple[str, ...]) -> list[Any]:
        return await asyncio.gather(*(members[p].run(0, peers, flat[p], samples[p], ids=lists[p][0],
                                                     receipts=lists[p][1]) for p in peers), return_exceptions=True)

    outcomes = run_all(round_of(group))
    for peer, outcome in zip(group, outcomes, strict=True):
        assert isinstance(outcome, RoundFailed), outcome
        if peer != "peerC":
            assert outcome.unreachable == frozenset({"peerC"}), outcome
    honest = run_all(round_of(("peerA", "peerB")))
    assert all(isinstance(r, RoundResult) and r.samples == 9 and r.ids == sorted(lists["peerA"][0] + lists["peerB"][0])
               for r in honest), honest


@pytest.mark.parametrize("tamper", ["samples", "missing", "other stage"])
def test_a_contribution_whose_receipts_do_not_show_its_claim_is_refused_as_poison(tamper: str) -> None:
    keys, shown = receipts("peerB", {"m1": 2, "m2": 2})
    samples = 4
    if tamper == "samples":
        samples = 40  # more samples than the receipts show
    elif tamper == "missing":
        shown = shown[:1]
    else:
        shown[1] = [2, sign_receipt(TRAINER, keys[1], 0, "peerB", 2)]
    members = make_members(["peerA", "peerB"], timeout=SHORT, bounds=Bounds(receipts=True))

    async def main() -> None:
        round_ = asyncio.create_task(members["peerA"].run(0, ("peerA", "peerB"), torch.zeros(10), 0))
        await asyncio.sleep(0)
        try:
            with pytest.raises(BadRequest, match=POISON):
                await members["peerA"].contribute(_meta(samples=samples, ids=keys, receipts=shown),
                                                  [torch.zeros(5)], "peerB")
        finally:
            round_.cancel()
            await asyncio.gather(round_, return_exceptions=True)

    run_all(main())


def test_a_member_that_never_sends_its_part_is_named_by_every_member_even_after_a_groupmate_gave_up() -> None:
    """peerC takes part in nothing. peerB's patience runs out first: it names peerC and gives its round up,
    so peerA's part to peerB is answered "abandoned" long before peerA's own timeout. peerA names peerC too,
    at once (its part never reached peerA either), so that both leave it out of their next groups; before,
    peerA failed without a name and kept proposing peerC, which peerB kept refusing."""
    group = ("peerA", "peerB", "peerC")
    members: dict[str, StageAllReduce] = {}
    for peer, timeout in (("peerA", 2.0), ("peerB", 0.5), ("peerC", 10.0)):  # peerC never runs its round
        members[peer] = StageAllReduce(LoopbackClient(peer, members, EXACT), peer, stage=1, timeout=timeout,
                                       on_wake=always, bounds=Bounds())
    flat = grads({"peerA": 1, "peerB": 1}, 30)

    async def main() -> list[Any]:
        return await asyncio.gather(*(members[p].run(0, group, flat[p], 1) for p in ("peerA", "peerB")),
                                    return_exceptions=True)

    started = time.monotonic()
    outcomes = run_all(main())
    assert all(isinstance(o, RoundFailed) and o.unreachable == frozenset({"peerC"}) for o in outcomes), outcomes
    assert time.monotonic() - started < 1.8  # peerA did not wait out its own 2 s
