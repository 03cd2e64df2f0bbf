"""The compute gate's lock: waiters in order of arrival, a step's urgent turn before all of them and a
backward's before forwards, and no turn lost to a waiter cancelled before or after its turn came."""

from __future__ import annotations

import asyncio

import pytest

from swarm.server.turns import IN_TURN, SOON, URGENT, TurnLock


async def hold(lock: TurnLock, name: str, order: list[str], rank: int = IN_TURN) -> None:
    if rank == URGENT:
        async with lock.urgent():
            order.append(name)
            await asyncio.sleep(0)
    elif rank == SOON:
        async with lock.turn(SOON):
            order.append(name)
            await asyncio.sleep(0)
    else:
        async with lock:
            order.append(name)
            await asyncio.sleep(0)


async def queued(lock: TurnLock, *jobs: tuple[str, int]) -> list[str]:
    """Run `jobs` (name, rank) queued in that order behind a holder, and the order they held the lock."""
    order: list[str] = []
    await lock.acquire()
    tasks = []
    for name, rank in jobs:
        tasks.append(asyncio.create_task(hold(lock, name, order, rank)))
        await asyncio.sleep(0)  # each queued before the next
    lock.release()
    await asyncio.gather(*tasks)
    assert not lock.locked()
    return order


def test_waiters_hold_in_order_of_arrival_and_urgent_ones_before_them() -> None:
    lock = TurnLock()
    assert asyncio.run(queued(lock, ("a", IN_TURN), ("b", IN_TURN), ("c", IN_TURN))) == ["a", "b", "c"]
    jobs = (("fwd1", IN_TURN), ("fwd2", IN_TURN), ("step", URGENT), ("fwd3", IN_TURN), ("load", URGENT))
    assert asyncio.run(queued(TurnLock(), *jobs)) == ["step", "load", "fwd1", "fwd2", "fwd3"]


def test_backwards_go_after_urgent_turns_and_before_the_forwards_waiting() -> None:
    jobs = (("fwd1", IN_TURN), ("bwd1", SOON), ("fwd2", IN_TURN), ("step", URGENT), ("bwd2", SOON))
    assert asyncio.run(queued(TurnLock(), *jobs)) == ["step", "bwd1", "bwd2", "fwd1", "fwd2"]


def test_an_urgent_turn_waits_for_the_job_running() -> None:
    async def scenario() -> list[str]:
        lock, order = TurnLock(), []
        await lock.acquire()
        step = asyncio.create_task(hold(lock, "step", order, URGENT))
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
