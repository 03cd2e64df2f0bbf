"""Delay and loss of a peer's RPC messages, read from a small JSON file that a fault injector writes.

Kernels without `netem` cannot delay or drop packets, so peers do it themselves: when
`net.fault_file` names a file, every stage call this peer makes or serves first waits `delay`
seconds, and is lost with probability `drop` (or always, with `blackhole`): the reply never comes and
the caller's deadline ends the call, exactly as with a lost packet stream. `methods` narrows the rules
to those RPC methods: a blackhole on `forward` and `backward` alone is a server whose compute hangs
while its all-reduce and records go on. The file is re-read when it changes, so faults come and go
while the peer runs. DHT traffic is not affected; cut a network namespace's link (`swarm.ops.netlab`)
for a real partition.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
RECHECK_SECONDS = 0.25  # how stale the rules may be


@dataclass(frozen=True)
class Rules:
    delay: float = 0.0
    drop: float = 0.0
    blackhole: bool = False
    methods: tuple[str, ...] = ()  # the RPC methods the rules apply to (none named: every one)


class FaultFile:
    def __init__(self, path: str | Path, rng: random.Random | None = None):
        self.path = Path(path)
        self.rng = rng or random.Random()
        self.rules = Rules()
        self._checked = -float("inf")
        self._mtime: float | None = None

    def current(self) -> Rules:
        now = time.monotonic()
        if now - self._checked < RECHECK_SECONDS:
            return self.rules
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self._mtime, self.rules = None, Rules()
            return self.rules
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                raw = json.loads(self.path.read_text())
                methods = raw.get("methods", [])
                if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
                    raise ValueError(f"methods must be a list of method names, not {methods!r}")
                self.rules = Rules(float(raw.get("delay", 0.0)), float(raw.get("drop", 0.0)),
                                   bool(raw.get("blackhole", False)), tuple(methods))
            except (OSError, ValueError, TypeError, AttributeError) as e:
                log.warning("ignoring unreadable fault file %s: %s", self.path, e)
                self.rules = Rules()
            log.info("fault rules now: %s", self.rules)
        return self.rules

    async def apply(self, method: str) -> None:
        """Before a `method` call goes out or is served: wait the delay; a lost message never completes."""
        rules = self.current()
        if rules.methods and method not in rules.methods:
            return
        if rules.delay > 0:
            await asyncio.sleep(rules.delay)
        if rules.blackhole or (rules.drop > 0 and self.rng.random() < rules.drop):
            await asyncio.Event().wait()  # the caller's deadline ends the exchange
