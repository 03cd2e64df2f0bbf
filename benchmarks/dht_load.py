"""What the DHT costs a swarm as it grows: every peer announces itself and reads its stages' records once a
period, as servers do, and the CPU of all the peers' DHT processes and p2pd daemons is counted.

    PYTHONPATH=src .venv/bin/python benchmarks/dht_load.py [--peers 5,8] [--settings 5/20,3/3]
        [--stages 3] [--seconds 25] [--one-search]

Each peer is a serving DHT node started as a swarm peer starts it (`swarm.net.node.start_dht`: the same
record validators), all on loopback. Once a second each stores a 600-byte record under its stage's key
(`--stages` keys, peers spread over them) and reads every stage's key with `latest=True`, one read per key,
or all keys in one search with `--one-search`. A setting `R/B` stores each record on R nodes (hivemind's
`num_replicas`, 5 by default) and reads from the B nodes nearest each key (`beam_size`, hivemind's default
for reads is its bucket size, 20): a swarm of more than B DHT nodes reads B of them, a smaller one all.
Printed per run: the cores the peers' helper processes used, and the records every read returned (each
peer's own must be among them). Fewer nodes asked is cheaper, and riskier for a value written once (a
tombstone, a data block's lease): it may have gone to other nodes than the ones a read asks.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time

from hivemind.utils import get_dht_time

from swarm.config.schema import NetConfig
from swarm.net import node
from swarm.net.lifeline import TiedDHT
from swarm.ops.procs import cpu_split, descendants

WARM_UP = 5.0  # seconds of the loop before counting


async def _latest(dht, dht_node, keys: tuple[str, ...]) -> dict:
    return await dht_node.get_many(keys, sufficient_expiration_time=float("inf"))


def helpers_cpu() -> float:
    """CPU seconds so far of every process below this one (the DHT processes and p2pd daemons)."""
    return sum(cpu_split(descendants(os.getpid()), ""))


def run(peers: int, replicas: int, beam: int, stages: int, seconds: float, one_search: bool) -> None:
    class Replicated(TiedDHT):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, num_replicas=replicas, **kwargs)

    node.TiedDHT = Replicated
    first = node.start_dht(NetConfig(host="127.0.0.1"))
    joined = tuple(str(a) for a in first.get_visible_maddrs())
    dhts = [first, *(node.start_dht(NetConfig(host="127.0.0.1", initial_peers=joined)) for _ in range(peers - 1))]
    keys = tuple(f"stage{k}" for k in range(stages))
    seen: list[int] = []
    stop = threading.Event()

    def loop(i: int) -> None:
        dht = dhts[i]
        while not stop.is_set():
            began = time.monotonic()
            dht.store(keys[i % stages], b"r" * 600, get_dht_time() + 6.0, subkey=dht.peer_id.to_bytes())
            if one_search:
                found = dht.run_coroutine(functools.partial(_latest, keys=keys)).values()
            else:
                found = [dht.get(key, latest=True, beam_size=beam) for key in keys]
            seen.append(sum(len(v.value) for v in found if v is not None))
            stop.wait(max(0.0, 1.0 - (time.monotonic() - began)))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(peers)]
    for t in threads:
        t.start()
    try:
        time.sleep(WARM_UP)
        cpu, wall, counted = helpers_cpu(), time.monotonic(), len(seen)
        time.sleep(seconds)
        cores = (helpers_cpu() - cpu) / (time.monotonic() - wall)
        rounds = seen[counted:]
    finally:
        stop.set()
        for t in threads:
            t.join()
        for dht in dhts:
            dht.shutdown()
    how = "one search" if one_search else f"beam {beam}"
    print(f"{peers} peers, {stages} stage keys, {replicas} replicas, {how}: {cores:.3f} cores "
          f"({cores / peers * 1000:.1f} ms of CPU per peer-second); records read per round: min {min(rounds)}, "
          f"max {max(rounds)} of {peers}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="5,8", help="DHT peers in each run (comma-separated)")
    parser.add_argument("--settings", default="5/20,3/3", help="replicas/beam pairs (comma-separated)")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--one-search", action="store_true", help="read every stage's key in one search")
    args = parser.parse_args()
    for peers in (int(p) for p in args.peers.split(",")):
        for setting in args.settings.split(","):
            replicas, beam = (int(v) for v in setting.split("/"))
            run(peers, replicas, beam, args.stages, args.seconds, args.one_search)


if __name__ == "__main__":
    main()
