"""How a peer ends: within a bound once told to stop, and without the interpreter's slow teardown.

A peer told to stop drains its work and leaves; if something it waits on never finishes (a call to a
peer that vanished, a helper that hangs), an operator's `systemctl stop` or a supervisor's restart
would wait forever. So a stop arms a deadline: past it, the peer prints every thread's stack and
every pending task (what it was stuck on, for a bug report) and exits with code 1.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
STUCK_EXIT_CODE = 1
STOP_MARGIN = 15.0  # seconds a stopping peer has beyond its own bound on draining work


def on_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None], grace: float, who: str) -> None:
    """SIGINT and SIGTERM call `stop`; the first of them also gives the process `grace` seconds to end."""
    armed: list[threading.Timer] = []

    def stopped() -> None:
        if not armed:
            armed.append(deadline(grace, who, loop))
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped)


def deadline(seconds: float, who: str, loop: asyncio.AbstractEventLoop | None = None) -> threading.Timer:
    """End the process `seconds` from now if it is still running then, saying where it was stuck."""

    def expire() -> None:
        log.error("%s is still not out %.0fs after it was told to stop: ending it; where it was stuck follows",
                  who, seconds)
        for task in _pending(loop):
            log.error("pending: %r", task)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logging.shutdown()
        os._exit(STUCK_EXIT_CODE)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def _pending(loop: asyncio.AbstractEventLoop | None) -> list[asyncio.Task]:
    """The loop's unfinished tasks, read from another thread: a best effort, for the report only."""
    if loop is None:
        return []
    try:
        return [t for t in asyncio.all_tasks(loop) if not t.done()]
    except RuntimeError:  # the set changed while it was read
        return []


def exit_now(code: int) -> None:
    """Exit with `code` once output is flushed, skipping the interpreter's teardown: with torch loaded
    it takes a second or more of CPU, and a peer that has left has nothing more to clean up."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
