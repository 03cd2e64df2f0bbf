"""What one DHT read costs a peer in CPU: through hivemind's DHT process (how every swarm peer runs its DHT
today), and on a DHT node in the peer's own process; and, with `--stores N`, what one store costs the
whole swarm, as hivemind makes it and as a swarm peer does (`swarm.net.nearest`).

    PYTHONPATH=src .venv/bin/python benchmarks/dht_cost.py [--reads 300] [--repeat 2]
    PYTHONPATH=src .venv/bin/python benchmarks/dht_cost.py --stores 200 [--nodes 5] [--repeat 2]

Reads: a bootstrap node holds one 1 KB record; a client-mode peer reads it `--reads` times with
`latest=True`, as `swarm.net.directory` does. The CPU counted is the reading peer's: its own process and
every process below it (the DHT process and p2pd daemon), not the bootstrap's. A swarm's server reads about
2.7 records a second and announces once a second, and each DHT node also answers the others' reads and writes.

Stores: `--nodes` serving DHT peers started as swarm peers start theirs (`swarm.net.node.start_dht`: the
same validators); one of them stores a 1.5 KB record under its own peer id (signed) `--stores` times. The
CPU counted is every peer's: each store is served by the nodes nearest its key.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarm.config.schema import NetConfig
from swarm.net.node import start_dht
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


def store_costs(nodes: int, stores: int, repeat: int) -> None:
    """Milliseconds of CPU of every process per store: hivemind's (any option of its own takes its path,
    here `await_all_replicas`, its default) and the swarm peer's."""
    first = start_dht(NetConfig(host="127.0.0.1"))
    joined = tuple(str(a) for a in first.get_visible_maddrs())
    dhts = [first, *(start_dht(NetConfig(host="127.0.0.1", initial_peers=joined)) for _ in range(nodes - 1))]
    writer, value = dhts[1], b"r" * 1500
    ways = {"hivemind's store": {"await_all_replicas": True}, "to the nodes found before": {}}
    try:
        time.sleep(2.0)  # every node in every routing table
        for _ in range(repeat):
            for name, options in ways.items():
                for _ in range(WARM_UP):
                    writer.store(KEY, value, get_dht_time() + 6.0, subkey=writer.peer_id.to_base58(), **options)
                cpu, wall = sum(cpu_split([os.getpid(), *descendants(os.getpid())], "")), time.monotonic()
                for _ in range(stores):
                    writer.store(KEY, value, get_dht_time() + 6.0, subkey=writer.peer_id.to_base58(), **options)
                cpu = sum(cpu_split([os.getpid(), *descendants(os.getpid())], "")) - cpu
                print(f"{name:<26} {cpu / stores * 1000:6.2f} ms CPU per store, every process of {nodes} "
                      f"peers; {(time.monotonic() - wall) / stores * 1000:6.2f} ms wall", flush=True)
    finally:
        for dht in dhts:
            dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--stores", type=int, default=0, help="time stores instead of reads, this many each way")
    parser.add_argument("--nodes", type=int, default=5, help="with --stores: DHT peers in the swarm")
    args = parser.parse_args()
    if args.stores:
        store_costs(args.nodes, args.stores, args.repeat)
        return
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
