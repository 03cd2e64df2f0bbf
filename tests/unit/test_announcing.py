"""A server's renewals of its record while the DHT stalls: a store that waits on an unresponsive DHT node
must not hold back the next one, or a live server's record lapses and trainers take it for gone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from swarm.server.announcing import OVERLAPPING, Announcer

PERIOD = 0.05


def announcer_with_stalled_stores() -> tuple[Announcer, list[asyncio.Event]]:
    """An announcer whose every store waits until the test releases it."""
    announcer = Announcer.__new__(Announcer)
    announcer.period, announcer.ttl = PERIOD, 100.0
    announcer.stage = SimpleNamespace(index=0, label="s0", lapsed=False, runtime=SimpleNamespace(pending_samples=0))
    announcer._announced_pending = 0
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
