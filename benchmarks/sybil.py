"""What a flood of fresh identities does to the directory, measured on live DHT nodes (loopback).

Identities cost nothing, so an attacker can sign valid server records under as many peer ids as it likes.
Here `--senders` attacker nodes (each its own libp2p identity) store `--records` such records, presigned
under fresh Ed25519 keys, under stage 1's key at every storage node, while an honest server keeps its own
record there. The figures: how long a trainer's read of the stage takes and what it returns, before and
after the flood; how many entries each storage node holds and how much its DHT process grew; and whether
an honest server that joins after the flood is seen.

    .venv/bin/python benchmarks/sybil.py [--records 100000] [--senders 20] [--storage-nodes 3] [--unbounded]

`--unbounded` lifts the per-key bounds (swarm.net.storage), to see what they prevent.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.config import load_config
from swarm.net import storage as bounds
from swarm.net.directory import Directory
from swarm.net.identity import PeerSignatures, peer_id_of
from swarm.net.node import start_dht
from swarm.ops.hostile import server_record
from swarm.wire.records import stage_key

RUN = "sybil"
BATCH = 1000  # records per store call: about 280 KiB, under hivemind's 4 MiB unary cap
FLOOD: list[tuple[str, bytes]] = []  # (peer id, signed value): made before the attackers' DHTs fork


def sign_flood(count: int, cfg, expiration: float) -> None:
    key = DHTID.generate(source=stage_key(RUN, 1)).to_bytes()
    for _ in range(count):
        fake = Ed25519PrivateKey.generate()
        me = peer_id_of(fake.public_key())
        value = MSGPackSerializer.dumps(server_record(cfg, me, 1, throughput=1e9, capacity=1e9, epoch=10**9)
                                        .to_value())
        subkey = MSGPackSerializer.dumps(me)
        FLOOD.append((me, PeerSignatures(fake).sign_value(DHTRecord(key, subkey, value, expiration))))


async def push(_dht, node, targets: list, first: int, last: int, expiration: float) -> int:
    """Store FLOOD[first:last] at every target; how many entries the targets took in all."""
    key_id, taken = DHTID.generate(source=stage_key(RUN, 1)), 0
    for start in range(first, last, BATCH):
        chunk = FLOOD[start:min(start + BATCH, last)]
        for target in targets:
            ok = await node.protocol.call_store(target, keys=[key_id] * len(chunk), values=[v for _, v in chunk],
                                                expiration_time=expiration, subkeys=[p for p, _ in chunk])
            taken += sum(bool(x) for x in ok or [])
    return taken


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def timed_read(directory: Directory) -> tuple[float, list]:
    started = time.perf_counter()
    found = await directory.stage(1)
    return time.perf_counter() - started, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--senders", type=int, default=20)
    parser.add_argument("--storage-nodes", type=int, default=3)
    parser.add_argument("--unbounded", action="store_true", help="lift the per-key bounds")
    args = parser.parse_args()
    if args.unbounded:
        bounds.MAX_SUBKEYS = bounds.MAX_SUBKEYS_PER_SENDER = 1 << 62
    cfg = load_config(overrides=[f'net.run_id="{RUN}"', 'net.host="127.0.0.1"', "net.record_ttl=240.0"])
    expiration = get_dht_time() + 200  # within the lifetime servers are listed for: every record counts
    started = time.perf_counter()
    sign_flood(args.records, cfg, expiration)
    print(f"signed {args.records} records under fresh keys in {time.perf_counter() - started:.1f} s", flush=True)

    def node(client: bool = False, peers: list[str] = ()):
        net = load_config(overrides=[f'net.run_id="{RUN}"', 'net.host="127.0.0.1"',
                                     "net.initial_peers=" + repr(list(peers)).replace("'", '"')]).net
        return start_dht(net, client_mode=client)

    storage = [node()]
    first = [str(a) for a in storage[0].get_visible_maddrs()]
    storage += [node(peers=first) for _ in range(args.storage_nodes - 1)]
    reader, honest = node(client=True, peers=first), node(client=True, peers=first)
    attackers = [node(client=True, peers=first) for _ in range(args.senders)]
    loop = asyncio.new_event_loop()
    honest_dir = Directory(honest, RUN, 240.0)
    me = honest.peer_id.to_base58()
    loop.run_until_complete(honest_dir.announce_server(server_record(cfg, me, 1)))
    directory = Directory(reader, RUN, 240.0)
    before, found = loop.run_until_complete(timed_read(directory))
    print(f"before: read in {before * 1000:.0f} ms, {len(found)} server(s)", flush=True)
    grown = {d.pid: rss_mb(d.pid) for d in storage}
    targets = [d.peer_id for d in storage]
    share = -(-args.records // args.senders)
    started = time.perf_counter()
    taken = sum(a.run_coroutine(functools.partial(push, targets=targets, first=i * share,
                                                  last=min((i + 1) * share, args.records), expiration=expiration))
                for i, a in enumerate(attackers))
    print(f"flood: {args.records} records x {len(targets)} nodes sent by {args.senders} peers in "
          f"{time.perf_counter() - started:.1f} s; entries taken: {taken}", flush=True)
    reads = [loop.run_until_complete(timed_read(directory)) for _ in range(5)]
    times = sorted(t for t, _ in reads)
    found = reads[-1][1]
    listed = "among them" if me in {r.peer_id for r in found} else "MISSING"
    print(f"after: reads in {times[len(times) // 2] * 1000:.0f} ms (median of 5, max {times[-1] * 1000:.0f}), "
          f"{len(found)} servers listed, the honest one {listed}")
    print("storage nodes' DHT processes grew by " + ", ".join(f"{rss_mb(pid) - mb:.0f}" for pid, mb in grown.items())
          + " MB")
    late = node(client=True, peers=first)
    newcomer = server_record(cfg, late.peer_id.to_base58(), 1)
    loop.run_until_complete(Directory(late, RUN, 240.0).announce_server(newcomer))
    found = loop.run_until_complete(timed_read(directory))[1]
    print("an honest server joining after the flood is " +
          ("seen" if late.peer_id.to_base58() in {r.peer_id for r in found} else "not seen"))
    for d in [late, *attackers, honest, reader, *storage]:
        d.shutdown()


if __name__ == "__main__":
    main()
