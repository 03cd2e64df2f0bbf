"""The compute gate's lock: waiters in order of arrival, a step's urgent turn before all of them, and
no turn lost to a waiter cancelled before or after its turn came."""

from __future__ import annotations

import asyncio

import pytest

from swarm.server.turns import TurnLock


async def hold(lock: TurnLock, name: str, order: list[str], urgent: bool = False) -> None:
    if urgent:
        async with lock.urgent():
            order.append(name)
            await asyncio.sleep(0)
    else:
        async with lock:
            order.append(name)
            await asyncio.sleep(0)


async def queued(lock: TurnLock, *jobs: tuple[str, bool]) -> list[str]:
    """Run `jobs` (name, urgent) queued in that order behind a holder, and the order they held the lock."""
    order: list[str] = []
    await lock.acquire()
    tasks = []
    for name, urgent in jobs:
        tasks.append(asyncio.create_task(hold(lock, name, order, urgent)))
        await asyncio.sleep(0)  # each queued before the next
    lock.release()
    await asyncio.gather(*tasks)
    assert not lock.locked()
    return order


def test_waiters_hold_in_order_of_arrival_and_urgent_ones_before_them() -> None:
    lock = TurnLock()
    assert asyncio.run(queued(lock, ("a", False), ("b", False), ("c", False))) == ["a", "b", "c"]
    jobs = (("fwd1", False), ("fwd2", False), ("step", True), ("fwd3", False), ("load", True))
    assert asyncio.run(queued(TurnLock(), *jobs)) == ["step", "load", "fwd1", "fwd2", "fwd3"]


def test_an_urgent_turn_waits_for_the_job_running() -> None:
    async def scenario() -> list[str]:
        lock, order = TurnLock(), []
        await lock.acquire()
        step = asyncio.create_task(hold(lock, "step", order, urgent=True))
        await asyncio.sleep(0.01)
        order.append("running job done")
        lock.release()
        await step
        return order

    assert asyncio.run(scenario()) == ["running job done", "step"]


def test_a_waiter_cancelled_in_the_queue_or_as_its_turn_comes_passes_the_lock_on() -> None:
    async def scenario() -> list[str]:
        lock, order = TurnLock(), []
        await lock.acquire()
        gone = asyncio.create_task(hold(lock, "gone", order))
        late = asyncio.create_task(hold(lock, "late", order))
        last = asyncio.create_task(hold(lock, "last", order))
        await asyncio.sleep(0)
        gone.cancel()  # while queued
        await asyncio.sleep(0)
        lock.release()  # to "late", which is cancelled before it runs
        late.cancel()
        await last
        for task in (gone, late):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not lock.locked()
        await asyncio.wait_for(lock.acquire(), 1.0)  # free again
        return order

    assert asyncio.run(scenario()) == ["last"]


def test_releasing_a_free_lock_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        TurnLock().release()
