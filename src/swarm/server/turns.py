"""The compute gate's lock: first come, first served, except that a stage's step goes first.

A step round (and loading a state to catch up) holds the gate for the whole stage: its other replicas
wait on it in the all-reduce. Queued behind a server's forwards and backwards, it waits for all of them,
which at a slow replica is many seconds: the others give up on it, step without it, and it falls behind
and must download the stage's whole state. Urgent turns therefore go before every turn not yet begun
(the job running goes on), in their own order of arrival.

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
