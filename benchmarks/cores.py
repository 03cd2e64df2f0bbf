"""Where a local swarm's cores go: CPU time per kind of process, over the steady part of a fault-free run.

    PYTHONPATH=src .venv/bin/python benchmarks/cores.py [--steps 6] [--set section.field=value ...]

Runs the swarm of benchmarks/peers.py's fault-free scenario (the same model and settings, `--set` on top)
and samples /proc once a second for every process this one started: each peer's main process (a server's
split into its event loop, the main thread, and its other threads, where the compute runs), the DHT
process hivemind forks for it, and the p2pd daemon that process starts. The figures are cores used on
average from the swarm's warm-up step to the moment its trainer stopped starting microbatches, the window
benchmarks/peers.py times. The single process would use every core for compute; whatever the swarm spends
elsewhere is what it gives up against it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from swarm.ops.report import collect

sys.path.insert(0, str(Path(__file__).parent))
from peers import ISSUE_MODEL, swarm_run, warmed_up  # noqa: E402  (sibling scripts, not a package)

ROLES = ("server", "trainer")  # `swarm.cli.main <role>`
TICKS = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[str, int, int] | None:
    """(command name, parent pid, CPU ticks so far) of a /proc stat file, None if it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return text[text.find("(") + 1:text.rfind(")")], int(fields[1]), int(fields[11]) + int(fields[12])


def _role(cmdline: str) -> str | None:
    words = cmdline.split()
    return next((w for w in ROLES if "swarm.cli.main" in words and w in words), None)


def snapshot(root: int) -> Counter[str]:
    """CPU ticks so far of every process under `root`, summed by kind."""
    procs: dict[int, tuple[str, int, int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(f"/proc/{entry}/stat")):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            procs[int(entry)] = (*found, cmdline)

    def owner(pid: int) -> int | None:
        """The peer process `pid` belongs to (the one `root` started), or None if it is not ours."""
        while pid in procs and procs[pid][1] != root:
            pid = procs[pid][1]
        return pid if pid in procs else None

    ticks: Counter[str] = Counter()
    for pid, (name, _, used, _) in procs.items():
        top = owner(pid)
        if pid == root or top is None:
            continue
        role = _role(procs[top][3]) or "this benchmark's bootstrap peer and status reads"
        if name == "p2pd":
            ticks[f"{role}: p2pd daemon"] += used
        elif pid != top:
            ticks[f"{role}: DHT process"] += used
        elif role == "server":
            main = _stat(f"/proc/{pid}/task/{pid}/stat")
            ticks["server: main thread (event loop)"] += main[2] if main else 0
            ticks["server: other threads (compute)"] += used - (main[2] if main else 0)
        else:
            ticks[f"{role}: main process"] += used
    return ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps, after one warm-up")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", default="runs/bench-cores")
    args = parser.parse_args()

    samples: list[tuple[float, Counter[str]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            samples.append((time.time(), snapshot(os.getpid())))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = swarm_run([*ISSUE_MODEL, *args.overrides], args.steps, args.run_dir)
    done.set()
    sampler.join()

    start = warmed_up(Path(args.run_dir))
    end = collect(Path(args.run_dir))["_stopped_starting"] or samples[-1][0]
    (t0, first), (t1, last) = (min(samples, key=lambda s: abs(s[0] - t)) for t in (start, end))
    cores = {kind: (last[kind] - first[kind]) / TICKS / (t1 - t0) for kind in last}
    print(f"swarm: {result['samples_per_second']:.2f} samples/s; window {t1 - t0:.0f} s "
          f"({os.cpu_count()} cores on this machine)")
    for kind, used in sorted(cores.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:46s} {used:6.3f} cores")
    print(f"  {'all of the swarm':46s} {sum(cores.values()):6.3f} cores")


if __name__ == "__main__":
    main()
