"""What a swarm's peers cost while nobody trains: the servers' processes, the DHT processes hivemind forks from
them, their p2p daemons and the launcher's bootstrap peer, read from /proc by kind of process (`peers.CpuSampler`).
Whatever the work, a peer pays this: its records renewed, its health probed, its DHT node answering others' reads
and stores. A rank of torch's pipeline, between steps, pays nothing.

    PYTHONPATH=src .venv/bin/python benchmarks/at_rest.py [--seconds 60] [--set section.field=value ...]

The swarm is peers.py's (`ISSUE_MODEL` and the overrides given, one server per stage unless `local.layout` says
otherwise) and no trainer; it is measured once every server has announced itself and `--settle` seconds more.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from swarm.config import load_config
from swarm.ops.local import LocalSwarm, start_layout

sys.path.insert(0, str(Path(__file__).parent))
from peers import ISSUE_MODEL, CpuSampler  # noqa: E402  (a sibling script, not a package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the swarm at rest is measured")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after every server is up, first")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with TemporaryDirectory(prefix="swarm-at-rest-") as run_dir:
        cfg = load_config(overrides=[*ISSUE_MODEL, *args.overrides, f'run_dir="{run_dir}"'])
        layout = start_layout(cfg)
        swarm = LocalSwarm(cfg)
        try:
            swarm.start_servers()
            asyncio.run(swarm.wait_for_servers())
            time.sleep(args.settle)
            with CpuSampler() as cpu:
                since = time.time()
                time.sleep(args.seconds)
                until = time.time()
        finally:
            swarm.stop()
    cores = cpu.cores(since, until)
    if cores is None:
        raise SystemExit("a process started or ended while the swarm was measured: run again")
    seconds = cores.pop("seconds")
    print(f"{len(layout)} stages, servers {list(layout)}, at rest for {seconds:.0f}s: "
          f"{sum(cores.values()):.3f} cores in all")
    for kind, used in sorted(cores.items(), key=lambda kv: -kv[1]):
        if used:
            print(f"  {kind:<20} {used:.4f}")


if __name__ == "__main__":
    main()
