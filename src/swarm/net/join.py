"""The greeting a joining peer exchanges with peers already in the swarm: their clock, and a dial-back.

Every listening peer (the bootstrap `swarm dht` and every stage server) answers `rpc_hello`. A server
that joins greets its initial peers and asks each to open a TCP connection back to it, at the address
the greeted peer sees it connect from and the port it listens on: a server behind a NAT or a firewall
that trainers cannot connect to would be routed to and time out every call, so it is refused at start
instead. The dial-back goes only to the caller's own address, so a greeting cannot make a peer connect
anywhere else, and one dial-back runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from swarm.core.joining import ClockSample
from swarm.net.secret import AUTH_KEY, SwarmSecret

log = logging.getLogger(__name__)

MAX_HELLO_BYTES = 256  # a greeting carries a few ports
MAX_PORTS = 4
DIAL_TIMEOUT = 3.0



class NotMember(PermissionError):
    """The caller does not hold this private swarm's secret: it gets nothing."""

class JoinServicer(ServicerBase):
    def __init__(self, p2p: P2P, secret: SwarmSecret | None = None):
        self.p2p = p2p
        self.secret = secret
        self._dialing = asyncio.Lock()

    async def rpc_hello(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        reply: dict = {"time": time.time()}
        try:
            ports = _ports(request.metadata, self.secret, context)
        except ValueError as e:
            reply["error"] = str(e)
        else:
            if ports:
                reply["reachable"], reply["seen_as"] = await self._dial_back(context.remote_id, ports)
        reply["time"] = time.time()
        return runtime_pb2.ExpertResponse(metadata=msgpack.packb(reply))

    async def _dial_back(self, caller: PeerID, ports: list[int]) -> tuple[bool, str]:
        hosts = [h for h in {_host(a) for info in await self.p2p.list_peers() if info.peer_id == caller
                             for a in info.addrs} if h]
        async with self._dialing:
            for host in hosts:
                for port in ports:
                    if await _connects(host, port):
                        return True, f"{host}:{port}"
        return False, ",".join(hosts)


def _ports(metadata: bytes, secret: SwarmSecret | None, context: P2PContext) -> list[int]:
    if len(metadata) > MAX_HELLO_BYTES:
        raise ValueError("greeting too large")
    meta = msgpack.unpackb(metadata) if metadata else {}
    if secret is not None and not (isinstance(meta, dict) and secret.admits(
            context.remote_id.to_base58(), context.local_id.to_base58(), meta.get(AUTH_KEY))):
        raise NotMember("not a member of this private swarm")
    ports = meta.get("ports", []) if isinstance(meta, dict) else None
    if not isinstance(ports, list) or len(ports) > MAX_PORTS or not all(
            isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise ValueError("ports must be a short list of port numbers")
    return ports


def _host(addr: Multiaddr) -> str | None:
    for proto in ("ip4", "ip6"):
        try:
            return addr.value_for_protocol(proto)
        except LookupError:  # not this protocol
            continue
    return None


async def _connects(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


@dataclass(frozen=True)
class Greeting:
    peer: str
    clock: ClockSample
    reachable: bool | None  # None: not asked, or the peer could not say
    seen_as: str = ""


async def greet(p2p: P2P, peers: list[str], ports: list[int], timeout: float = 10.0,
                clock: Callable[[], float] = time.time, secret: SwarmSecret | None = None) -> list[Greeting]:
    """Greet each peer at once; peers that do not answer in time are left out. `clock` is this peer's
    wall clock."""
    me = p2p.peer_id.to_base58()

    async def one(peer: str) -> Greeting | None:
        hello = {"ports": ports[:MAX_PORTS], **({AUTH_KEY: secret.token(me, peer)} if secret else {})}
        request = runtime_pb2.ExpertRequest(metadata=msgpack.packb(hello))
        sent = clock()
        try:
            stub = JoinServicer.get_stub(p2p, PeerID.from_base58(peer))
            response = await stub.rpc_hello(request, timeout=timeout)
            reply = msgpack.unpackb(response.metadata)
            sample = ClockSample(sent, float(reply["time"]), clock())
        except Exception as e:  # an old or foreign peer, a dead one, a garbled reply: no greeting
            log.debug("no greeting from %s: %s", peer[-6:], e)
            return None
        reachable = reply.get("reachable")
        return Greeting(peer, sample, reachable if isinstance(reachable, bool) else None, str(reply.get("seen_as", "")))

    found = await asyncio.gather(*(one(p) for p in peers))
    return [g for g in found if g is not None]


def peer_ids(maddrs: list[str] | tuple[str, ...]) -> list[str]:
    """The peer ids named by multiaddrs (their /p2p/ part), each once, in order."""
    ids: list[str] = []
    for addr in maddrs:
        try:
            peer = Multiaddr(addr).value_for_protocol("p2p")
        except (MultiaddrError, LookupError, ValueError):  # an address without a /p2p/ part names no peer to greet
            continue
        if peer and peer not in ids:
            ids.append(peer)
    return ids
