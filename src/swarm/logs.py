"""How every peer's log lines look, and reading back when a line was written (benchmarks and tests
time events from peers' logs)."""

from __future__ import annotations

import logging
import re
from datetime import datetime

from swarm.net.quiet import QuietRepeats

FORMAT = "%(asctime)s.%(msecs)03d %(levelname).1s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
_STAMP = re.compile(r"(\d\d):(\d\d):(\d\d)\.(\d\d\d) ")


def setup(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT, datefmt=DATE_FORMAT)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    aio = logging.getLogger("asyncio")
    if not any(isinstance(f, QuietRepeats) for f in aio.filters):
        aio.addFilter(QuietRepeats(aio, "socket.send() raised exception.", "writes to lost connections"))


def logged_at(line: str) -> float | None:
    """When a log line of today was written (unix seconds, to the millisecond); None for other lines."""
    found = _STAMP.match(line)
    if found is None:
        return None
    h, m, s, ms = map(int, found.groups())
    return datetime.now().replace(hour=h, minute=m, second=s, microsecond=ms * 1000).timestamp()
