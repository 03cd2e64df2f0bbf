"""A local peer's processes as the operating system sees them: its own process group and its helpers'
(hivemind's DHT process and p2pd live in a process group of their own; see `swarm.net.lifeline`).
A fault that stands for a whole machine (killed, frozen) reaches all of them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now (its children, theirs, ...), read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while being read
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], {pid}
    while frontier:
        below = {p for p, parent in parents.items() if parent in frontier}
        found += sorted(below)
        frontier = below
    return found


def signal_machine(pid: int, sig: int) -> None:
    """Send `sig` to the process group of `pid` and to those of all its descendants."""
    groups = set()
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(p))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)


def cpu_split(pids: Iterable[int], name: str) -> tuple[float, float]:
    """CPU seconds (user and system) used so far by the threads of `pids` named `name` (as the kernel shows
    them, e.g. the servers' compute threads: `swarm.server.gate.COMPUTE_THREAD`), and by all their others."""
    tick = os.sysconf("SC_CLK_TCK")
    named = other = 0.0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                comm = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited while being read
            used = (int(fields[11]) + int(fields[12])) / tick
            if comm == name:
                named += used
            else:
                other += used
    return named, other
