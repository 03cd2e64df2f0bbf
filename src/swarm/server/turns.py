"""The compute gate's lock: first come, first served, except that a stage's step goes first.

A step round takes the gate twice, to take the replica's gradient sum out and to step on the stage's
mean, and a catch-up takes it to load a state. The stage's other replicas wait on the first (their
round cannot complete without this replica's part) and, at a slow replica, the second decides whether
it steps in time to stay with its stage: behind a queue of forwards and backwards, each many seconds on
a slow server, the others give up on it, step without it, and it must download the stage's whole state.
Urgent turns therefore go before every turn not yet begun (the job running goes on), in their own order
of arrival.

Ownership passes straight from holder to next waiter, so nobody barges in between.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class TurnLock:
    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[asyncio.Future] = deque()
        self._waiting: deque[asyncio.Future] = deque()

    def locked(self) -> bool:
        return self._held

    async def acquire(self, urgent: bool = False) -> None:
        if not self._held:  # (a release hands the lock to any waiter left: none waits while it is free)
            self._held = True
            return
        turn = asyncio.get_running_loop().create_future()
        queue = self._urgent if urgent else self._waiting
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
        for queue in (self._urgent, self._waiting):
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
    async def urgent(self) -> AsyncIterator[None]:
        """Hold the lock, ahead of every waiter that is not urgent."""
        await self.acquire(urgent=True)
        try:
            yield
        finally:
            self.release()
