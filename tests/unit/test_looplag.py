"""The event-loop lag a peer reports in its summary (swarm.looplag)."""

from __future__ import annotations

import asyncio
import time

from swarm.looplag import BLOCKED, LoopLag


def test_a_loop_held_by_blocking_work_is_seen_and_counted_once() -> None:
    async def scenario() -> LoopLag:
        lag = LoopLag()
        lag.watch(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        time.sleep(BLOCKED + 0.05)  # holds the loop, as an inline decode of a huge tensor would
        await asyncio.sleep(0.05)
        lag.unwatch()
        return lag

    lag = asyncio.run(scenario())
    assert lag.worst >= BLOCKED + 0.05 and lag.blocked == 1
    assert lag.as_dict()["peak_rss_mb"] > 0


def test_a_loop_that_only_waits_shows_no_lag_and_watching_wakes_it_no_more_often() -> None:
    async def scenario() -> tuple[LoopLag, int]:
        loop = asyncio.get_running_loop()
        lag = LoopLag()
        lag.watch(loop)
        polls = 0
        timed = loop._selector.select

        def counted(timeout: float | None = None) -> list:
            nonlocal polls
            polls += 1
            return timed(timeout)

        loop._selector.select = counted  # (an attribute of the watch's own selector: set on it, not the loop's)
        await asyncio.sleep(0.3)
        lag.unwatch()
        return lag, polls

    lag, polls = asyncio.run(scenario())
    assert lag.worst < BLOCKED and lag.blocked == 0
    assert polls <= 3  # the sleep's own wake-up (and the turns around it), not one every few milliseconds


def test_unwatching_gives_the_loop_its_own_selector_back() -> None:
    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        own = loop._selector
        lag = LoopLag()
        lag.watch(loop)
        watched = loop._selector is not own
        lag.unwatch()
        await asyncio.sleep(0.01)  # the loop still polls and wakes
        return watched and loop._selector is own

    assert asyncio.run(scenario())
