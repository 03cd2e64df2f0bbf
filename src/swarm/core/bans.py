"""Temporary bans of servers that failed, growing while a server keeps failing."""

from __future__ import annotations

# 2**60 times any sane base already exceeds any sane cap; bounding the exponent avoids float overflow.
_MAX_DOUBLINGS = 60


class BanList:
    """Per-peer bans whose length doubles with each consecutive failure, up to `max_seconds`.

    A failure reported while the peer is still banned does not lengthen the ban: several requests
    that were in flight to one server usually fail together, and that is one outage, not many.

    A ban whose every failure was the peer being slow (`slow=True`: it is alive, behind a queue) is
    kept apart: callers still send it what only it can serve cheaply (see `swarm.trainer.calls`).
    """

    def __init__(self, base_seconds: float, max_seconds: float) -> None:
        if base_seconds < 0 or max_seconds < base_seconds:
            raise ValueError(f"need 0 <= base_seconds <= max_seconds, got {base_seconds}, {max_seconds}")
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self._until: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._slow: set[str] = set()  # peers whose running ban only ever saw slow failures

    def ban(self, peer_id: str, now: float, base: float | None = None, slow: bool = False) -> float:
        """Record a failure of `peer_id`; returns how long it stays banned from `now`. `base`, if shorter than
        `base_seconds`, stands for it in this ban (a call that timed out: see `swarm.trainer.calls`)."""
        if not slow:
            self._slow.discard(peer_id)
        if self.is_banned(peer_id, now):
            return self.remaining(peer_id, now)
        if slow:
            self._slow.add(peer_id)
        failures = self._failures.get(peer_id, 0)
        first = self.base_seconds if base is None else min(base, self.base_seconds)
        duration = min(first * 2.0 ** min(failures, _MAX_DOUBLINGS), self.max_seconds)
        self._failures[peer_id] = failures + 1
        self._until[peer_id] = now + duration
        return duration

    def forgive(self, peer_id: str) -> None:
        """A success resets the failure count, but a running ban is left to expire.

        A reply may belong to a request sent long before the failure that caused the ban, so it does
        not prove the server keeps up now; it only means the next failure starts from the base again.
        """
        self._failures.pop(peer_id, None)

    def is_banned(self, peer_id: str, now: float) -> bool:
        return self._until.get(peer_id, now) > now

    def only_slow(self, peer_id: str, now: float) -> bool:
        """Whether `peer_id` is banned now for being slow alone, with no failure of another kind."""
        return self.is_banned(peer_id, now) and peer_id in self._slow

    def remaining(self, peer_id: str, now: float) -> float:
        return max(0.0, self._until.get(peer_id, now) - now)

    def banned(self, now: float) -> set[str]:
        """Peers banned at `now`; expired bans are dropped here (failure counts stay until forgiven)."""
        self._until = {p: t for p, t in self._until.items() if t > now}
        return set(self._until)

    def failing(self) -> set[str]:
        """Peers whose last call failed (banned now or not): what they announce is not to be relied on."""
        return set(self._failures)
