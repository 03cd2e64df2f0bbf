"""How long a stage's all-reduce round waits for its members, and what ends the wait early or late.

A round waits `net.allreduce_timeout` (the floor) until one has completed here, then as long as rounds
have been taking. Two things move that: a member that is seen gone from the stage's records ends the
wait at once, and a member that is slow but alive makes it longer (see `Patience.wait`). Both read the
stage's records, the same records trainers leave a server's calls by.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from swarm.averaging.failures import RoundFailed
from swarm.averaging.rounds import Round
from swarm.core.throughput import LatencyTracker
from swarm.net.directory import short

log = logging.getLogger("swarm.averaging.allreduce")
ROUND_CEILING = 4.0  # a round waits at most this many times `net.allreduce_timeout`, however long rounds took
RECHECK = 2.0  # seconds between reads of the stage's records while a round waits for a late member
CONFIRM = 1.0  # seconds to the read that confirms a lapse: a live member renews its record every second


class Patience:
    def __init__(self, floor: float, at_epoch: Callable[[int, frozenset[str]], Awaitable[frozenset[str]]] | None = None,
                 lapsed: Callable[[frozenset[str]], Awaitable[frozenset[str]]] | None = None):
        """`floor`: `net.allreduce_timeout`, what a round waits before any round was timed here;
        `at_epoch(epoch, members)`: those of `members` a fresh read of the stage's records shows live at
        `epoch`; `lapsed(members)`: those whose records lapsed (`Directory.lapsed`). None: the records are
        not consulted."""
        self.floor = floor
        self.ceiling = ROUND_CEILING * floor
        self.at_epoch, self.lapsed = at_epoch, lapsed
        self._took = LatencyTracker()  # how long this member's completed rounds took

    @property
    def timeout(self) -> float:
        """Seconds a round waits for its parts: the floor, or longer where this member's completed rounds
        took long (a slow groupmate, a slow link, a large stage): their mean and four deviations, up to the
        ceiling. A round given up at a slow groupmate leaves it out of the next groups and splits the
        stage's replicas (`swarm.server.stepping`); waiting as long as rounds take avoids that."""
        return self._took.timeout(self.floor, self.ceiling) if self._took.observed else self.floor

    def observe(self, seconds: float) -> None:
        """A round completed here in `seconds`."""
        self._took.observe(seconds)

    async def wait(self, rnd: Round, own_id: str, tasks: list[asyncio.Future], gathered: asyncio.Future) -> list:
        """`gathered` (the round's exchanges, `tasks` in the group's order) within the round's timeout;
        TimeoutError past it, or RoundFailed naming the members it waits on that are gone.

        Every RECHECK seconds the wait ends if a member whose part, or answer to ours, has not come is seen
        gone from the stage's records (it stopped renewing them: frozen, cut off or dead) by two checks in a
        row, the second CONFIRM seconds after the first: one read can come back partial under load, and a
        slow machine's renewal can be late, while stepping without a live member makes it download the
        stage's state. That comes within a record's lifetime and two checks, where the timeout is 15 s or
        more, while the groupmates' gradients pile up unstepped and the other stages step on without them.
        A check reads nothing while every such member's last record read is still live.

        The wait goes past the timeout, up to the ceiling, in two cases:
        - Every member's part for ours has come: those members are alive and in this round, and an owner's
          answer that is late is a slow machine reducing its part (our part's answer has gone out, so the
          others may step with it, and giving up would leave us a step behind them).
        - No round has completed here yet, so the timeout is the floor, which knows nothing of how slow
          the group is, and the stage's records show every member whose part is missing live at the round's
          epoch: a slow replica still finishing the job it had begun (a step goes before queued work, not
          before the running one), not a dead one. Such a member is waited for while each read, every
          RECHECK seconds, still shows it so. A hostile member can hold a server's first round so, once: the
          retry leaves it out (swarm.server.stepping), completes, and is timed.

        (asyncio.timeout, not wait_for: wait_for can lose a cancellation.)"""
        deadline, until = rnd.began + self.ceiling, rnd.began + self.timeout
        missed: frozenset[str] = frozenset()  # members the last check found lapsed
        while True:
            try:
                async with asyncio.timeout(max(0.0, min(CONFIRM if missed else RECHECK, until - time.monotonic()))):
                    return await asyncio.shield(gathered)
            except TimeoutError:
                gone, missed = missed & (lapsed := await self._lapsed(rnd, own_id, tasks)), lapsed
                if gone:
                    rnd.silent = gone
                    raise RoundFailed(f"epoch {rnd.epoch}: [{','.join(map(short, sorted(gone)))}] gone from the "
                                      f"stage's records after {time.monotonic() - rnd.began:.0f}s", gone) from None
                if time.monotonic() < until:
                    continue
                if time.monotonic() >= deadline or not await self._wait_longer(rnd):
                    raise
                until = min(time.monotonic() + RECHECK, deadline)

    async def _lapsed(self, rnd: Round, own_id: str, tasks: list[asyncio.Future]) -> frozenset[str]:
        """The members whose part, or answer to ours, the round still waits on, and whose records lapsed."""
        waiting = frozenset(m for m, task in zip(rnd.group, tasks, strict=True)
                            if m != own_id and (m not in rnd.contributions or not task.done()))
        return await self.lapsed(waiting) if waiting and self.lapsed is not None else frozenset()

    async def _wait_longer(self, rnd: Round) -> bool:
        missing = frozenset(rnd.group) - rnd.contributions.keys()
        if missing and (self._took.observed or self.at_epoch is None
                        or not missing <= await self.at_epoch(rnd.epoch, missing)):
            return False
        if not rnd.waited_longer:
            rnd.waited_longer = True
            why = (f"no part yet from [{','.join(map(short, sorted(missing)))}], live at this epoch in the stage's "
                   "records" if missing else "every part for ours is in")
            log.info("epoch %d: %s; waiting up to %.0fs", rnd.epoch, why, self.ceiling)
        return True
