"""A hostile peer, run as a process of its own against a live swarm (the adversarial tests start it):

    python -m tests.integration.hostile ATTACK --config RUN/config.toml --initial-peers ADDR... --seconds N

It joins the swarm's DHT as any stranger can and attacks for N seconds, then exits. Attacks:

- `forged-record`: announces itself as a server of stage 1 at epoch 10^9 with a throughput of 10^9
  samples/s, renewed every second, and serves nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from hivemind.utils import get_dht_time

from swarm.config import agreed, config_hash, load_config
from swarm.net.directory import Directory
from swarm.net.node import start_dht
from swarm.wire import PROTOCOL_VERSION
from swarm.wire.records import ServerRecord

ATTACKS = ("forged-record",)


async def forged_record(directory: Directory, me: str, cfg, seconds: float) -> None:
    shared = agreed(cfg)
    record = ServerRecord(peer_id=me, stage=1, throughput=1e9, queue=0, epoch=10**9, pending=0,
                          config_hash=config_hash(cfg), model=shared["model"], optim=shared["optim"],
                          protocol=PROTOCOL_VERSION, capacity=1e9, tenure=1e6)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        await directory.announce_server(record)
        await asyncio.sleep(1.0)


async def main(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    net = load_config(overrides=[f"net.initial_peers={list(args.initial_peers)!r}".replace("'", '"')]).net
    dht = start_dht(net, client_mode=True)
    try:
        directory = Directory(dht, cfg.net.run_id, cfg.net.record_ttl)
        me = dht.peer_id.to_base58()
        print(f"hostile {args.attack} from {me} at {get_dht_time():.1f}", flush=True)
        await forged_record(directory, me, cfg, args.seconds)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("--config", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    asyncio.run(main(parser.parse_args()))
