"""The compute gate's lock: first come, first served, except that a stage's step goes first and a
backward before the forwards waiting.

A step round takes the gate twice, to take the replica's gradient sum out and to step on the stage's
mean, and a catch-up takes it to load a state. The stage's other replicas wait on the first (their
round cannot complete without this replica's part) and, at a slow replica, the second decides whether
it steps in time to stay with its stage: behind a queue of forwards and backwards, each many seconds on
a slow server, the others give up on it, step without it, and it must download the stage's whole state.
Urgent turns therefore go before every turn not yet begun (the job running goes on), in their own order
of arrival.

Backwards through a graph kept here come next (`SOON`), as a 1F1B schedule runs them: such a backward
finishes a microbatch whose forward this server already computed, and only this server holds its graph.
Behind a queue of forwards, at a slow server, it can outwait its call, and the trainer then has another
replica recompute the forward. A forward kept waiting costs nothing of the kind: it is turned away or
expires before it is computed (`swarm.server.backlog`), and goes elsewhere. Such backwards cannot keep
forwards waiting for ever, as each follows a forward of its own; a backward to recompute is new work and
waits its turn.

Ownership passes straight from holder to next waiter, so nobody barges in between.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

URGENT, SOON, IN_TURN = 0, 1, 2  # ranks of a turn: steps and catch-ups, backwards, everything else


class TurnLock:
    def __init__(self) -> None:
        self._held = False
        self._queues: tuple[deque[asyncio.Future], ...] = (deque(), deque(), deque())  # by rank

    def locked(self) -> bool:
        return self._held

    async def acquire(self, rank: int = IN_TURN) -> None:
        if not self._held:  # (a release hands the lock to any waiter left: none waits while it is free)
            self._held = True
            return
        turn = asyncio.get_running_loop().create_future()
        queue = self._queues[rank]
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the lock, then cancelled: hand it on
                self.release()
            elif turn in queue:  # (a release meanwhile may have passed it over already)
                queue.remove(turn)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("release of a lock not held")
        for queue in self._queues:
            while queue:
                turn = queue.popleft()
                if not turn.done():
                    turn.set_result(None)  # still held: it is that waiter's now
                    return
        self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()

    @asynccontextmanager
    async def turn(self, rank: int) -> AsyncIterator[None]:
        """Hold the lock, ahead of every waiter of a lower rank (a larger number)."""
        await self.acquire(rank)
        try:
            yield
        finally:
            self.release()

    def urgent(self) -> AbstractAsyncContextManager[None]:
        """Hold the lock, ahead of every waiter that is not urgent."""
        return self.turn(URGENT)
