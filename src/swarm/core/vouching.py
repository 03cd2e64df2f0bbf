"""Whether a stage's state downloaded from one replica may be applied, and whose weights replicas that
diverged all take.

A state's checksum (`digest`) proves only that its bytes are what its sender meant to send: a hostile
replica can serve well-formed, finite, wrong weights with a digest of its own. But every replica announces
the digest of its weights at its epoch in its DHT record, signed with its identity (`swarm.net.identity`),
and replicas at one epoch hold bit-identical weights (the all-reduce checks it every round). So a state is
taken only when the stage's other replicas vouch for it: at least two of them announced its digest at its
epoch, or the only one at that epoch did. The second case is a hole this rule cannot close: a replica
alone at its epoch (one that stepped while the others were behind, or one that merely claims to be
ahead) cannot be cross-checked, and is believed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Announced = tuple[str, int, str]  # (peer, epoch, digest of its weights) as one of its records announced them
VOUCHERS = 2  # replicas that must announce a digest when more than one replica is at its epoch
# reads of the stage's records, an announcement period apart, before a state is refused: a replica that just
# stepped may serve its new state a moment before its record (and those of the replicas that stepped with it)
# announce the new digest
LOOKS = 4


def vouched(digest: str, epoch: int, announced: Iterable[Announced], me: str) -> bool:
    """Whether a state at `epoch` with `digest` is vouched for by the replicas other than `me`, in the
    records `announced` (any number of reads: a record once read is its writer's word, and a replica
    that just stepped may announce its new digest a moment after it serves the state)."""
    if not digest:
        return False
    at_epoch: dict[str, set[str]] = {}
    for peer, e, d in announced:
        if e == epoch and peer != me:
            at_epoch.setdefault(peer, set()).add(d)
    for_it = sum(digest in ds for ds in at_epoch.values())
    return for_it >= VOUCHERS or (len(at_epoch) == 1 and for_it == 1)


def keeper(digests: Mapping[str, str]) -> str:
    """Of replicas holding different weights at one epoch (peer -> digest of its weights), the one whose
    weights all of them take: the smallest peer id among those holding the digest most of them hold (a
    tie goes to the digest whose smallest holder is smallest). The majority's weights, so that the others'
    downloads of them are vouched for (`vouched`) wherever two or more replicas agree."""
    holders: dict[str, list[str]] = {}
    for peer in sorted(digests):
        holders.setdefault(digests[peer], []).append(peer)
    return min(holders.values(), key=lambda peers: (-len(peers), peers[0]))[0]
