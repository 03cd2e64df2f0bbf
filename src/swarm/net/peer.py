"""This process's place in a swarm, set up the same way for servers and trainers: its DHT peer, the
client it calls stages with, the directory it reads and announces in."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import hivemind
from hivemind.p2p import P2P

from swarm.config import NetConfig, WireConfig
from swarm.net.directory import Directory
from swarm.net.faultfile import FaultFile
from swarm.net.lifeline import guard
from swarm.net.node import check_join, start_dht
from swarm.net.protocol import Traffic
from swarm.net.receipts import ReceiptSigner
from swarm.net.secret import SwarmSecret, load_secret
from swarm.net.transport import StageClient

T = TypeVar("T")


@dataclass
class SwarmPeer:
    dht: hivemind.DHT
    p2p: P2P
    client: StageClient
    directory: Directory
    faults: FaultFile | None  # fault injection's delay/loss rules for this peer's stage calls, if any
    peer_id: str
    net: NetConfig
    secret: SwarmSecret | None  # a private swarm's (see swarm.net.secret)
    sign: ReceiptSigner  # this peer's receipts for the gradients it hands replicas (see swarm.net.receipts)

    async def leave(self) -> None:
        """Close this process's connection to the p2p daemon (which removes the socket it listened on for
        calls: left behind, one file per peer that ever served piles up in the temp directory), then the DHT
        peer with its daemon."""
        await self.p2p.shutdown()
        self.dht.shutdown()

    async def guard(self, work: Awaitable[T], *watchers: Awaitable[None]) -> T:
        """`work`'s result, unless this peer's network stack dies first (see `swarm.net.lifeline.guard`)."""
        return await guard(work, self.dht, self.p2p, self.net, *watchers)


async def join(net: NetConfig, wire: WireConfig, traffic: Traffic, serving: bool) -> SwarmPeer:
    """Join the DHT (in client mode unless `serving`) and check this peer against the swarm (its clock,
    and, for a server, that others can connect to it; see `check_join`)."""
    dht = start_dht(net, client_mode=not serving)
    try:
        p2p = await dht.replicate_p2p()
        faults = FaultFile(net.fault_file) if net.fault_file else None
        secret = load_secret(net.secret_path)
        client = StageClient(p2p, faults, wire.policy(), traffic, net.emulated_rtt_ms / 2000, secret)
        await check_join(dht, p2p, net, serving, secret=secret)
        directory = Directory(dht, net.run_id, net.record_ttl)
        me = dht.peer_id.to_base58()
        return SwarmPeer(dht, p2p, client, directory, faults, me, net, secret, ReceiptSigner(dht.identity, me))
    except BaseException:
        dht.shutdown()
        raise
