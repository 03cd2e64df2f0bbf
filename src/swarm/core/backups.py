"""Who holds a copy of each stage's state outside the stage, when a copy is refreshed, and what a server
entering a stage does when no replica of it is alive.

Copies are spread by rendezvous hashing: every peer ranks the candidates for a stage by a hash of
(stage, peer id) and the first `holders` hold it. Each peer computes this from the same DHT listing,
so no coordination is needed, and a peer joining or leaving moves only the copies it is ranked for.
Stragglers rank after every other candidate: a copy's download costs a server the same bytes whatever
its speed, so it takes a slow one longest, while its stage's rounds wait on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def rank(stage: int, peer_id: str) -> str:
    return hashlib.sha256(f"{stage}/{peer_id}".encode()).hexdigest()


STRAGGLER = 0.5  # a server computing under this fraction of its stage's fastest replica's rate is a straggler


def stragglers(rates: dict[int, dict[str, float]]) -> set[str]:
    """The servers under STRAGGLER of the throughput of their stage's fastest replica, from the rates
    (samples per second of compute) their records announce. Rates, not the work routed to them: a
    server's stage is the only fair yardstick, as stages differ in cost."""
    slow: set[str] = set()
    for peers in rates.values():
        fastest = max(peers.values(), default=0.0)
        slow |= {peer for peer, rate in peers.items() if rate < STRAGGLER * fastest}
    return slow


def holders_of(stage: int, layout: dict[int, list[str]], holders: int, slow: set[str] | None = None) -> list[str]:
    """The servers that hold a copy of `stage`: the first `holders` by rank among the servers of every
    other stage (a stage's own servers would die with it in the failures copies are for), the `slow`
    ones after all the others."""
    candidates = {p for k, peers in layout.items() if k != stage for p in peers}
    return sorted(candidates, key=lambda p: (p in (slow or ()), rank(stage, p)))[:holders]


def stages_to_hold(me: str, layout: dict[int, list[str]], holders: int, slow: set[str] | None = None) -> set[int]:
    """The stages whose copy this server holds, given every stage's servers (`layout`)."""
    return {stage for stage in layout if me in holders_of(stage, layout, holders, slow)}


def needs_refresh(held: int | None, stage_epoch: int, every: int) -> bool:
    """Whether a copy at epoch `held` (None: no copy) is due, the stage being at `stage_epoch`: a stage
    that has not stepped has nothing to keep; after that a copy is at most `every` steps behind."""
    if stage_epoch <= 0:
        return False
    return held is None or stage_epoch >= held + every


def pause_after(download_seconds: float, max_share: float) -> float:
    """Seconds a holder lets pass after a download before it refreshes a copy again, so that refreshes
    take at most `max_share` of its time (see `backup.max_share`)."""
    return download_seconds * (1 / max_share - 1)


def may_drop(held: int, wanted: bool, replica_epochs: list[int]) -> bool:
    """A copy no longer ours to hold goes only once a live replica has the stage at least as far: the
    last copy of a stage whose replicas all died is never dropped."""
    return not wanted and any(e >= held for e in replica_epochs)


@dataclass(frozen=True)
class Entry:
    """What a server entering a stage with no live replica does."""

    action: str  # "resume": serve what it holds; "restore": take `source`'s copy; "wait"; "fresh"
    source: str | None = None
    epoch: int = 0  # the epoch it will serve from
    lost: int = 0  # steps the stage is known to have taken beyond that epoch (lost with its replicas)
    reason: str = ""


def plan_entry(own: int, copies: list[tuple[str, int, int]], progressed: bool, fresh_allowed: bool,
               stage_seen: int = 0) -> Entry:
    """The entry of a server holding its stage at epoch `own` (0: initial weights; more: from its own
    checkpoint) into a stage with no live replica. `copies`: (holder, epoch, newest stage epoch the
    holder saw) of every copy found; `progressed`: whether the run is past its start (another stage has
    stepped); `stage_seen`: the newest epoch the server saw its stage's replicas at, in earlier looks.

    The newest state reachable wins. Initial weights are served mid-run only when the operator allows
    it (`fresh_allowed`); otherwise the server waits for a copy (a holder may still be joining). A stage
    once seen past its start has progressed whatever a later read of the other stages misses: a server
    that came as the stage's last replica died saw it further along, then found no record of it once the
    dead one's had lapsed, and a read of the DHT under that churn can miss the other stages' too."""
    seen = max([own, stage_seen, *(c[2] for c in copies)])
    progressed = progressed or stage_seen > 0
    best = max(copies, key=lambda c: c[1], default=None)
    if best is not None and best[1] > own:
        return Entry("restore", best[0], best[1], seen - best[1], f"the newest copy is at epoch {best[1]}")
    if own > 0:
        return Entry("resume", None, own, seen - own, f"its own checkpoint is at epoch {own}")
    if not progressed:
        return Entry("fresh", None, 0, 0, "the run is starting")
    if fresh_allowed:
        return Entry("fresh", None, 0, seen, "the operator allowed a fresh start")
    return Entry("wait", None, 0, seen, "the run has progressed but no replica, copy or checkpoint of the stage is"
                 " reachable")
