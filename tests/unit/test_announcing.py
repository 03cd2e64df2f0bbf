"""A server's renewals of its record: while the DHT stalls, a store that waits on an unresponsive DHT node
must not hold back the next one, or a live server's record lapses and trainers take it for gone; a record
without news is renewed every `renew_every`, and news goes out at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from swarm.config import NetConfig
from swarm.net.directory import RENEW_PERIODS
from swarm.server.announcing import OVERLAPPING, Announcer
from swarm.wire.calls import CountNote

PERIOD = 0.05


def bare_announcer(renew_every: float = PERIOD, tell=None) -> Announcer:
    """An announcer of a stage far from its step, with no other replica seen at its epoch and nothing
    announced yet; `tell`: its `count` calls."""
    announcer = Announcer({"optim": {"target_batch_size": 64}}, "h", "s0", NetConfig(announce_period=1.0), "me",
                          None, None, None, None, tell)
    announcer.period, announcer.ttl, announcer.renew_every = PERIOD, 100.0, renew_every
    announcer.stage = SimpleNamespace(
        index=0, label="s0", lapsed=False, moving_to=None, fresh=False, previous_stage=None,
        runtime=SimpleNamespace(pending_samples=0, epoch=0, last_digest="d0"),
        work=SimpleNamespace(fold=lambda period: None), near_step=lambda period, target: False,
        plan=SimpleNamespace(peers_at_epoch=(-1, frozenset())))
    return announcer


def announcer_with_stalled_stores() -> tuple[Announcer, list[asyncio.Event]]:
    """An announcer whose every store waits until the test releases it."""
    announcer = bare_announcer()
    announcer._announced_news = announcer.news()  # (a renewal, not news, then sends each store)
    stores: list[asyncio.Event] = []

    async def announce() -> None:
        stores.append(release := asyncio.Event())
        await release.wait()

    announcer.announce = announce
    return announcer, stores


def test_renewals_go_out_while_earlier_stores_wait_up_to_a_bound() -> None:
    async def scenario() -> None:
        announcer, stores = announcer_with_stalled_stores()
        loop = asyncio.create_task(announcer.loop())
        try:
            # renewals fall due every period although none of them completes
            async with asyncio.timeout(20 * PERIOD):
                while len(stores) < OVERLAPPING:
                    await asyncio.sleep(PERIOD / 5)
            await asyncio.sleep(5 * PERIOD)
            assert len(stores) == OVERLAPPING  # no more than that wait at once
            stores[0].set()  # one store ends: the next renewal goes out
            async with asyncio.timeout(20 * PERIOD):
                while len(stores) == OVERLAPPING:
                    await asyncio.sleep(PERIOD / 5)
            assert len(stores) == OVERLAPPING + 1
        finally:
            loop.cancel()
            for release in stores:
                release.set()

    asyncio.run(scenario())


def recording_announcer(renew_every: float, tell=None) -> tuple[Announcer, list[tuple[float, tuple]]]:
    """An announcer whose stores complete at once, recording when each went out and the news it told."""
    announcer = bare_announcer(renew_every, tell)
    sent: list[tuple[float, tuple]] = []

    async def announce() -> None:
        sent.append((time.monotonic(), announcer.news()))
        announcer._announced_news = announcer.news()
        announcer._announced_pending = announcer.stage.runtime.pending_samples

    announcer.announce = announce
    return announcer, sent


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(PERIOD / 5)


def test_a_record_without_news_is_renewed_every_other_period() -> None:
    async def scenario() -> None:
        announcer, sent = recording_announcer(RENEW_PERIODS * PERIOD)
        loop = asyncio.create_task(announcer.loop())
        try:
            await until(lambda: len(sent) >= 5)
        finally:
            loop.cancel()
        gaps = [b - a for (a, _), (b, _) in zip(sent[1:], sent[2:], strict=False)]  # (the first one is news)
        assert all(gap >= RENEW_PERIODS * PERIOD * 0.99 for gap in gaps), gaps

    asyncio.run(scenario())


def test_news_goes_out_at_once_and_near_a_step_the_sample_count_too() -> None:
    """With renewals far apart, every announcement after the first is one for news: a step (epoch and
    weights), a move; near a step beside other replicas, a new sample count. Far from it, a new count
    waits for the renewal."""
    async def scenario() -> None:
        announcer, sent = recording_announcer(renew_every=1000.0)
        st = announcer.stage
        loop = asyncio.create_task(announcer.loop())
        try:
            await until(lambda: len(sent) == 1)
            st.runtime.epoch, st.runtime.last_digest = 1, "d1"
            await until(lambda: len(sent) == 2)
            assert sent[-1][1][1:3] == (1, "d1")
            st.moving_to = 1
            await until(lambda: len(sent) == 3)
            st.runtime.pending_samples = 8  # far from the step: not news
            assert not announcer.has_news(near=False)
            st.near_step = lambda period, target: True
            await until(lambda: len(sent) == 4)
            assert not announcer.has_news(near=True)
        finally:
            loop.cancel()
        assert len(sent) == 4

    asyncio.run(scenario())


def test_near_a_step_counts_go_to_the_replicas_at_our_epoch_straight_and_by_the_dht_where_that_fails() -> None:
    """Each new count is told to each replica at our epoch by a `count` call, with increasing sequence
    numbers, and the DHT record is not stored for it. Once a call fails, counts go by the DHT for a period."""
    async def scenario() -> None:
        notes: list[tuple[str, CountNote]] = []
        failing = False

        async def tell(peer: str, note: CountNote) -> None:
            if failing:
                raise ConnectionError("unreachable")
            notes.append((peer, note))

        announcer, sent = recording_announcer(renew_every=1000.0, tell=tell)
        announcer.period = 10 * PERIOD  # (the DHT carries counts for a period after a failed call)
        st = announcer.stage
        loop = asyncio.create_task(announcer.loop())
        try:
            await until(lambda: len(sent) == 1)
            st.plan.peers_at_epoch = (0, frozenset({"b", "c"}))
            st.near_step = lambda period, target: True
            st.runtime.pending_samples = 40
            await until(lambda: len(notes) == 2)
            st.runtime.pending_samples = 48
            await until(lambda: len(notes) == 4)
            assert sorted((peer, n.pending) for peer, n in notes) == [("b", 40), ("b", 48), ("c", 40), ("c", 48)]
            assert [n.seq for _, n in notes] == sorted(n.seq for _, n in notes)
            assert {n.epoch for _, n in notes} == {0} and len(sent) == 1  # no DHT store for them
            failing = True
            st.runtime.pending_samples = 56
            await until(lambda: len(sent) == 2)  # the count by the DHT instead
            assert announcer._announced_pending == 56
        finally:
            loop.cancel()

    asyncio.run(scenario())


def test_a_short_lived_record_is_renewed_within_its_life() -> None:
    """Where a record lives less than a few renewals every other period, it is renewed every period."""
    directory = SimpleNamespace()
    for ttl, every in ((6.0, RENEW_PERIODS * 1.0), (1.5, 1.0)):
        net = NetConfig(announce_period=1.0, record_ttl=ttl, max_clock_offset=min(0.25, (ttl - 1.0) / 2))
        announcer = Announcer({"optim": {"target_batch_size": 64}}, "h", "s", net, "p", directory, None, None, None,
                              None)
        assert announcer.renew_every == every
