"""The event-loop lag a peer reports in its summary (swarm.looplag)."""

from __future__ import annotations

import asyncio
import time

from swarm.looplag import BLOCKED, LoopLag


def test_a_loop_held_by_blocking_work_is_seen_late_and_counted() -> None:
    async def scenario() -> LoopLag:
        lag = LoopLag(period=0.01)
        watching = asyncio.create_task(lag.loop())
        await asyncio.sleep(0.05)
        time.sleep(BLOCKED + 0.05)  # holds the loop, as an inline decode of a huge tensor would
        await asyncio.sleep(0.05)
        watching.cancel()
        return lag

    lag = asyncio.run(scenario())
    assert lag.worst >= BLOCKED and lag.blocked >= 1
    assert lag.as_dict()["peak_rss_mb"] > 0
