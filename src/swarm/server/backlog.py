"""How long a request arriving now would wait for the compute thread: the work queued ahead of it and
the rest of the job in progress, each priced at the seconds per sample such work took lately.

A server uses it to turn away at once a forward it could not start before its caller gives up. Taking
it would cost twice: the caller waits out its whole timeout before sending the microbatch elsewhere,
and the work, done late, is thrown away. A slow server whose trainers have not yet measured it (its
first calls come with a share a typical server would get) is where this happens.

Pure bookkeeping, no clocks of its own: the caller passes the time, so tests and a simulator drive it.
"""

from __future__ import annotations

import itertools

SMOOTHING = 0.5  # weight of the newest job in a pass's seconds per sample: a slowed server shows it at once


class Backlog:
    def __init__(self) -> None:
        self._per_sample: dict[str, float] = {}  # pass ("forward", "backward") -> wall seconds per sample
        self._queued: dict[int, tuple[str | None, int]] = {}  # token -> (pass, samples), waiting for the thread
        self._running: tuple[float, float] | None = None  # (started, its estimated seconds) of the job in progress
        self._tokens = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._queued)

    def cost(self, work: str | None, samples: int) -> float:
        """Estimated seconds of `samples` of `work`; 0 for work never timed (a step, a state's packing)."""
        return self._per_sample.get(work, 0.0) * samples if work is not None else 0.0

    def enqueue(self, work: str | None, samples: int) -> int:
        """A job starts waiting for the thread; the token names it to `leave`."""
        token = next(self._tokens)
        self._queued[token] = (work, samples)
        return token

    def leave(self, token: int) -> None:
        """The job stopped waiting: it got the thread, or it was given up."""
        self._queued.pop(token, None)

    def started(self, work: str | None, samples: int, now: float) -> None:
        self._running = (now, self.cost(work, samples))

    def finished(self, work: str | None, samples: int, seconds: float) -> None:
        """The job in progress took `seconds` of wall time, waiting for a core included: that is what the
        next request will wait for it."""
        self._running = None
        if work is None or samples <= 0:
            return
        observed = seconds / samples
        known = self._per_sample.get(work)
        self._per_sample[work] = observed if known is None else known + SMOOTHING * (observed - known)

    def wait(self, now: float) -> float:
        """Seconds before a job queued now would get the thread, as far as the timings tell."""
        running = 0.0
        if self._running is not None:
            started, estimate = self._running
            running = max(0.0, estimate - (now - started))
        return running + sum(self.cost(work, samples) for work, samples in self._queued.values())
