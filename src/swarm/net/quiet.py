"""A rate limit on log lines that strangers can provoke.

Garbage on the wire, calls over a peer's limit, callers without the swarm's secret: each is worth a line
in the log, but a hostile peer can produce them by the thousand (a fuzz run of 10,000 messages once wrote
4,802 lines), drowning whatever else the log has to say and filling the disk. `Quiet` lets through the
first few lines of each kind per interval and counts the rest; the count is logged as one summary line.

Nothing runs in the background: the summary of an interval is written lazily, by the first event of its
kind after the interval ended. A flood that stops altogether therefore leaves its last count unlogged
until the next event of that kind, which is the price of needing no task, timer or event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LINES_PER_INTERVAL = 5  # lines of one kind let through per interval
INTERVAL = 60.0  # seconds


@dataclass
class _Window:
    started: float
    logged: int = 0
    suppressed: int = 0


class Quiet:
    """Lets through `lines` log lines per kind every `interval` seconds, then one summary line per kind.

    Kinds are a few fixed phrases named by the code ("malformed stream messages"), never anything a peer
    chooses, so the state kept here stays a handful of entries. One instance may serve several event
    loops' threads (hivemind's and ours), hence the lock."""

    def __init__(self, logger: logging.Logger, lines: int = LINES_PER_INTERVAL, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.lines = lines
        self.interval = interval
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def admit(self, kind: str) -> bool:
        """Whether one more line of `kind` may be logged now. Writes first the summary of the kind's
        previous interval, when that interval is over and lines were held back in it."""
        now = self.clock()
        with self._lock:
            window = self._windows.get(kind)
            if window is None or now - window.started >= self.interval:
                if window is not None and window.suppressed:
                    self.logger.warning("… and %d more %s in the last %.0f s", window.suppressed, kind,
                                        now - window.started)
                window = self._windows[kind] = _Window(now)
            if window.logged < self.lines:
                window.logged += 1
                return True
            window.suppressed += 1
            return False

    def warning(self, kind: str, msg: str, *args: object) -> None:
        """`logger.warning(msg, *args)` if a line of `kind` may be logged now; otherwise counted."""
        if self.admit(kind):
            self.logger.warning(msg, *args)


class QuietRepeats(logging.Filter):
    """A filter for a library's logger whose line `message` comes once per write: asyncio logs
    "socket.send() raised exception." for every write to a connection already lost, so a reply streamed
    in chunks to a caller that went away (a round given up, a call cancelled) wrote dozens of identical
    lines at one millisecond. They are let through, and summed up, as `Quiet` does."""

    def __init__(self, logger: logging.Logger, message: str, kind: str, quiet: Quiet | None = None):
        super().__init__()
        self.message, self.kind = message, kind
        self.quiet = quiet or Quiet(logger)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message or self.quiet.admit(self.kind)
