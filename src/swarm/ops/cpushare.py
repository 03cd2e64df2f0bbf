"""CPU shares for local peers: each peer (with the helper processes it starts) in a cgroup of its own,
held to a CPU quota, as a machine of its own would be.

Peers sharing one host share its cores: a peer that idles hands its cores to the others, so a slow or
stalled peer costs the rest nothing, which a slow machine of a real swarm (or of a fixed pipeline) does.
A quota per peer makes each one a machine of that many cores. Needs root and a cgroup CPU controller
(v1's `cpu` hierarchy, or v2 with `cpu` enabled).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuShare:
    """A cgroup whose processes (and their children, started after they entered) use at most `cores`."""

    def __init__(self, name: str, cores: float):
        if cores <= 0:
            raise ValueError(f"a CPU share needs a positive number of cores, got {cores}")
        quota = max(1000, round(cores * PERIOD_US))
        if (V1 / "cpu.cfs_quota_us").exists():
            self.path = V1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in _read(V2 / "cgroup.controllers").split():
            if "cpu" not in _read(V2 / "cgroup.subtree_control").split():
                (V2 / "cgroup.subtree_control").write_text("+cpu")
            self.path = V2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            raise OSError("no cgroup CPU controller to hold a peer to its share (needs root and cgroups)")
        self.cores = cores

    def enter(self) -> None:
        """Move the calling process into the share (from a child before its exec, or a worker's start)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self, wait: float = 10.0) -> None:
        """Remove the cgroup once its processes are gone (killed ones, and a killed peer's daemon, may take
        seconds to leave it); one still inside after `wait` seconds keeps it."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


def quota_cores(cgroup_file: Path = Path("/proc/self/cgroup")) -> float | None:
    """The cores this process is held to by a cgroup CPU quota (its own group's or an ancestor's, the
    smallest), or None where it has none. A container's CPU limit is such a quota."""
    limits = []
    for line in _read(cgroup_file).splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            limits += _ancestors(V1, path, _v1_limit)
        elif controllers == "":
            limits += _ancestors(V2, path, _v2_limit)
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _ancestors(root: Path, path: str, limit) -> list[float | None]:
    parts = [part for part in path.split("/") if part]
    return [limit(root.joinpath(*parts[:depth])) for depth in range(len(parts) + 1)]


def _v1_limit(group: Path) -> float | None:
    quota, period = _read(group / "cpu.cfs_quota_us").strip(), _read(group / "cpu.cfs_period_us").strip()
    return int(quota) / int(period) if quota and period and int(quota) > 0 else None


def _v2_limit(group: Path) -> float | None:
    fields = _read(group / "cpu.max").split()
    return int(fields[0]) / int(fields[1]) if len(fields) == 2 and fields[0] != "max" else None


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
