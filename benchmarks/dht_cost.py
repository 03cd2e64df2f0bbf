"""What one DHT read costs a peer in CPU: through hivemind's DHT process (how every swarm peer runs its DHT
today), and on a DHT node in the peer's own process.

    PYTHONPATH=src .venv/bin/python benchmarks/dht_cost.py [--reads 300] [--repeat 2]

A bootstrap node holds one 1 KB record; a client-mode peer reads it `--reads` times with `latest=True`, as
`swarm.net.directory` does. The CPU counted is the reading peer's: its own process and every process below
it (the DHT process and p2pd daemon), not the bootstrap's. A swarm's server reads about 2.7 records a
second and announces once a second, and each DHT node also answers the others' reads and writes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarm.ops.procs import cpu_split, descendants

KEY, VALUE = "dht-cost", b"x" * 1000
WARM_UP = 10


def peer_cpu(exclude: int) -> float:
    """CPU seconds of this process and of all below it, but for the process tree of `exclude`."""
    skip = {exclude, *descendants(exclude)}
    pids = [p for p in (os.getpid(), *descendants(os.getpid())) if p not in skip]
    return sum(cpu_split(pids, ""))


async def timed(read, reads: int, bootstrap: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per read."""
    for _ in range(WARM_UP):
        await read()
    cpu, wall = peer_cpu(bootstrap), time.monotonic()
    for _ in range(reads):
        await read()
    return (peer_cpu(bootstrap) - cpu) / reads * 1000, (time.monotonic() - wall) / reads * 1000


async def through_process(peers: list[str], reads: int, bootstrap: int) -> tuple[float, float]:
    dht = hivemind.DHT(initial_peers=peers, client_mode=True, start=True)
    try:
        return await timed(lambda: dht.get(KEY, latest=True, return_future=True), reads, bootstrap)
    finally:
        dht.shutdown()


async def in_process(peers: list[str], reads: int, bootstrap: int) -> tuple[float, float]:
    node = await DHTNode.create(initial_peers=peers, client_mode=True)
    try:
        return await timed(lambda: node.get(KEY, latest=True), reads, bootstrap)
    finally:
        await node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    bootstrap = hivemind.DHT(start=True)
    try:
        bootstrap.store(KEY, VALUE, get_dht_time() + 3600)
        peers = [str(a) for a in bootstrap.get_visible_maddrs()]
        for _ in range(args.repeat):
            for name, way in (("through the DHT process", through_process), ("in the peer's process", in_process)):
                cpu, wall = asyncio.run(way(peers, args.reads, bootstrap.pid))
                print(f"{name:<24} {cpu:6.2f} ms CPU per read, {wall:6.2f} ms wall")
    finally:
        bootstrap.shutdown()


if __name__ == "__main__":
    main()
