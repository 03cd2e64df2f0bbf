"""How long a peer's event loop was kept from running: the lag of a timer that should fire every period.

Every call a server answers, every announcement and every all-reduce part goes through one event loop;
work that holds it (a decode too large for its payload, a check run inline) delays all of them at once. The
figures go into the peer's summary, so that a run under attack, or a slow one, shows whether the loop kept up.
"""

from __future__ import annotations

import asyncio
import resource
import time

PERIOD = 0.05  # seconds between wake-ups: a lag of BLOCKED is measured within half of it
BLOCKED = 0.1  # a lag this long counts as the loop having been blocked


class LoopLag:
    def __init__(self, period: float = PERIOD):
        self.period = period
        self.worst = 0.0  # seconds
        self.blocked = 0  # wake-ups at least BLOCKED late

    async def loop(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(self.period)
            lag = time.monotonic() - started - self.period
            self.worst = max(self.worst, lag)
            self.blocked += lag >= BLOCKED

    def as_dict(self) -> dict[str, float]:
        return {"max_loop_lag_s": round(self.worst, 4), "loop_lags_over_100ms": self.blocked,
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
