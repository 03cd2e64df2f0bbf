"""Background loops that outlive their own errors.

A peer runs several loops beside its main work (announcing, stepping, renewing leases, watching). One
that dies of an unexpected error, say a malformed record a stranger wrote, must not leave the peer
running without it, silently: it is logged with its traceback and started again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
RESTART_AFTER = 1.0  # seconds before a failed loop runs again


async def supervised(name: str, loop: Callable[[], Awaitable[None]], restart_after: float = RESTART_AFTER) -> None:
    """Run `loop()` until it returns (or is cancelled); each time it fails, log why and run it again."""
    while True:
        try:
            await loop()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the %s loop failed; it starts again in %.0fs", name, restart_after)
            await asyncio.sleep(restart_after)
