"""Starting this process's DHT peer, the one entry point every role uses to join a swarm."""

from __future__ import annotations

import hivemind

from swarm.config import NetConfig


def start_dht(net: NetConfig, client_mode: bool = False) -> hivemind.DHT:
    """A running DHT peer. Client-mode peers (trainers behind NAT) reach others but are not reachable."""
    return hivemind.DHT(
        initial_peers=list(net.initial_peers),
        host_maddrs=[f"/ip4/{net.host}/tcp/{net.port}"],
        client_mode=client_mode,
        start=True,
    )


def visible_addresses(dht: hivemind.DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]
