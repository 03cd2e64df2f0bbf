"""How long a peer's event loop was kept from running: the longest turn of the loop, from its selector's
answer to its next poll, while it ran the callbacks that answer woke.

Every call a server answers, every announcement and every all-reduce part goes through one event loop;
work that holds it (a decode too large for its payload, a check run inline) delays all of them at once. The
figures go into the peer's summary, so that a run under attack, or a slow one, shows whether the loop kept up.

Each turn is timed where the loop polls anyway, so watching costs no wake-ups of its own. (A timer that fired
20 times a second to see how late it came cost an idle server about 5 ms of CPU a second: each wake-up of a
process that had slept finds its caches cold.)
"""

from __future__ import annotations

import asyncio
import resource
import selectors
import time
from typing import Any

BLOCKED = 0.1  # seconds: a turn this long counts as the loop having been blocked


class LoopLag:
    def __init__(self) -> None:
        self.worst = 0.0  # seconds
        self.blocked = 0  # turns of at least BLOCKED
        self._watched: tuple[Any, selectors.BaseSelector] | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Time every turn of `loop` until `unwatch` (a loop without a selector, such as a proactor, is not
        watched: its summary then shows no lag)."""
        selector = getattr(loop, "_selector", None)
        if selector is None or self._watched is not None:
            return
        self._watched = loop, selector
        loop._selector = _TimedSelector(selector, self)  # noqa: SLF001  (the loop's own poll, timed)

    def unwatch(self) -> None:
        if self._watched is not None:
            loop, selector = self._watched
            loop._selector = selector  # noqa: SLF001
            self._watched = None

    def note(self, turn: float) -> None:
        self.worst = max(self.worst, turn)
        self.blocked += turn >= BLOCKED

    def as_dict(self) -> dict[str, float]:
        return {"max_loop_lag_s": round(self.worst, 4), "loop_lags_over_100ms": self.blocked,
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


class _TimedSelector:
    """A loop's selector, each turn between two of its polls reported to a `LoopLag`; everything else is the
    selector's own."""

    def __init__(self, selector: selectors.BaseSelector, lag: LoopLag):
        self._selector, self._lag = selector, lag
        self._answered: float | None = None  # (monotonic) when the last poll returned

    def select(self, timeout: float | None = None) -> list:
        if self._answered is not None:
            self._lag.note(time.monotonic() - self._answered)
        try:
            return self._selector.select(timeout)
        finally:
            self._answered = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._selector, name)
