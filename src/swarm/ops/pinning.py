"""Which cores each server of a local swarm keeps its compute thread on (`local.pin_compute`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

Cores = tuple[int, ...]


def core_sets(available: Collection[int], servers: int, per_server: int) -> list[Cores]:
    """`servers` disjoint sets of `per_server` of the `available` cores, lowest first; none (an empty list)
    where they do not suffice. Pinning some servers and not others would leave the unpinned ones whatever
    the pinned do not use: an unequal share, which the swarm would take for unequal speed."""
    cores = sorted(available)
    if servers <= 0 or per_server <= 0 or servers * per_server > len(cores):
        return []
    return [tuple(cores[i * per_server:(i + 1) * per_server]) for i in range(servers)]


def free_set(sets: Iterable[Cores], held: Collection[Cores]) -> Cores | None:
    """The first of `sets` that no running server holds: a server started later takes a gone one's."""
    return next((cores for cores in sets if cores not in held), None)
