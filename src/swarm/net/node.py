"""Starting this process's DHT peer, the one entry point every role uses to join a swarm."""

from __future__ import annotations

import hivemind
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from swarm.config import NetConfig


class JoinError(ConnectionError):
    """This peer could not join the swarm (no initial peer answered, or the port is taken)."""


def start_dht(net: NetConfig, client_mode: bool = False) -> hivemind.DHT:
    """A running DHT peer. Client-mode peers (trainers behind NAT) reach others but are not reachable."""
    try:
        return hivemind.DHT(
            initial_peers=list(net.initial_peers),
            host_maddrs=[f"/ip4/{net.host}/tcp/{net.port}"],
            client_mode=client_mode,
            start=True,
        )
    except P2PDaemonError as e:
        peers = ", ".join(net.initial_peers) or "none given"
        raise JoinError(f"{e} (initial peers: {peers}); check net.initial_peers and that they are up") from e


def visible_addresses(dht: hivemind.DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]
