"""Starting this process's DHT peer, the one entry point every role uses to join a swarm, and the
checks a newcomer makes against the peers it joined through (clock, reachability)."""

from __future__ import annotations

import ipaddress
import logging
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from swarm.config import NetConfig
from swarm.core.joining import judge_clock, judge_reachability
from swarm.core.retry import backoff_delay
from swarm.net.identity import DecodableValues, PeerSignatures, load_or_create, temporary_identity
from swarm.net.join import greet, peer_ids
from swarm.net.lifeline import TiedDHT
from swarm.net.protocol import bound_stream_messages
from swarm.net.secret import SealedRecords, SwarmSecret, load_secret
from swarm.net.storage import bound_dht_storage

log = logging.getLogger(__name__)
# what p2pd says when none of the initial peers could be connected to, and hivemind's DHT when none of them
# answered its first ping
UNREACHED = ("failed to connect to bootstrap peers", "none of the initial_peers responded to a ping")
MIN_RETRY_DELAY = 0.5  # seconds between attempts at least


class JoinError(ConnectionError):
    """This peer could not join the swarm (no initial peer answered, the port is taken, the swarm
    cannot reach it, or its clock is too far off)."""


def listen_address(net: NetConfig) -> str:
    version = ipaddress.ip_address(net.host).version
    return f"/ip{version}/{net.host}/tcp/{net.port}"


def start_dht(net: NetConfig, client_mode: bool = False) -> hivemind.DHT:
    """A running DHT peer, its processes tied to this one's life (see `swarm.net.lifeline`; start it from
    the main thread, whose exit ends them). Client-mode peers (trainers, `swarm status`) reach others but
    are not reachable, which is what lets them work from behind a NAT."""
    bound_stream_messages()
    bound_dht_storage()
    secret = load_secret(net.secret_path)
    return _join(net, lambda: _start(net, client_mode, secret))


def _join(net: NetConfig, start: Callable[[], hivemind.DHT], rng: random.Random | None = None) -> hivemind.DHT:
    """`start()`, again while none of the initial peers could be reached and `net.join_timeout` lasts (a peer
    started with its network, or while the bootstrap restarts); any other failure at once."""
    rng, attempt = rng or random.Random(), 0
    give_up = time.monotonic() + net.join_timeout
    while True:
        try:
            return start()
        except (P2PDaemonError, RuntimeError) as e:
            unreached = bool(net.initial_peers) and any(words in str(e) for words in UNREACHED)
            if not (unreached or isinstance(e, P2PDaemonError)):
                raise
            peers, left = ", ".join(net.initial_peers) or "none given", give_up - time.monotonic()
            if not unreached or left <= 0:
                raise JoinError(f"{e} (initial peers: {peers}); check net.initial_peers and that they are up") from e
            delay = min(left, max(MIN_RETRY_DELAY, backoff_delay(attempt, 1.0, 8.0, rng)))
            log.warning("none of the initial peers could be reached (%s): trying again in %.1fs, for %.0fs more",
                        peers, delay, left)
            time.sleep(delay)
            attempt += 1


def _start(net: NetConfig, client_mode: bool, secret: SwarmSecret | None) -> hivemind.DHT:
    """One attempt; a peer without a kept identity takes a fresh one each time (its daemon has read the
    key, or failed, once it returns: the key then stays in memory only)."""
    if net.identity_path:
        path, key = Path(net.identity_path), load_or_create(Path(net.identity_path))
    else:
        path, key = temporary_identity()
    try:
        dht = TiedDHT(
            initial_peers=list(net.initial_peers),
            host_maddrs=[listen_address(net)],
            announce_maddrs=list(net.announce_addrs) or None,
            identity_path=str(path),
            check_if_identity_free=False,  # (hivemind's check reads RSA keys only)
            record_validators=[PeerSignatures(key), DecodableValues()] + ([SealedRecords(secret)] if secret else []),
            use_relay=net.use_relay,
            use_auto_relay=net.use_auto_relay,
            client_mode=client_mode,
            # every read of ours asks for the latest records (`latest=True`), which hivemind's caching never
            # answers: pushing each value found to the nearest node lacking it, and re-reading cached keys
            # before they expire, would only add stores and lookups that every DHT node serves
            cache_nearest=0,
            cache_refresh_before_expiry=0,
            start=True,
        )
        dht.identity = key
        return dht
    finally:
        if not net.identity_path:
            shutil.rmtree(path.parent, ignore_errors=True)


def visible_addresses(dht: hivemind.DHT) -> list[str]:
    """The addresses other hosts can join this peer through: loopback ones only when there are no
    others (a peer that listens on 127.0.0.1 alone is reachable from its own host only)."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    outside = [a for a in addrs if not _loopback(a)]
    return outside or addrs


def _loopback(addr: str) -> bool:
    for proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(Multiaddr(addr).value_for_protocol(proto)).is_loopback
        except LookupError:
            continue
    return False


async def check_join(dht: hivemind.DHT, p2p: P2P, net: NetConfig, serving: bool,
                     clock: Callable[[], float] = time.time, secret: SwarmSecret | None = None) -> None:
    """Greet the initial peers: compare clocks (warn, or refuse past `net.max_clock_offset`) and, for a
    peer that others must connect to (`serving`), have them dial back; refuse one nobody can reach.

    A swarm's first peer has no one to greet, and peers that do not answer (down, or an older
    version) are left out: with no answer at all the checks are skipped with a warning."""
    peers = [p for p in peer_ids(net.initial_peers) if p != dht.peer_id.to_base58()]
    if not peers:
        return
    addrs = visible_addresses(dht)
    ports = sorted({int(Multiaddr(a).value_for_protocol("tcp")) for a in addrs if "/tcp/" in a})
    greetings = await greet(p2p, peers, ports if serving else [], clock=clock, secret=secret)
    if not greetings:
        log.warning("none of the initial peers answered a greeting: clock and reachability not checked")
        return
    clock = judge_clock([g.clock for g in greetings], net.max_clock_offset)
    if clock.verdict == "refuse":
        raise JoinError(f"{clock.describe()}, more than net.max_clock_offset={net.max_clock_offset}s: DHT records "
                        "expire on their writer's clock, so this peer would vanish from the swarm or linger after "
                        "it left. Synchronize the clock (e.g. enable NTP: `timedatectl set-ntp true`)")
    if clock.verdict == "warn":
        log.warning("%s; records and deadlines tolerate up to %.1fs, but synchronize it (NTP)",
                    clock.describe(), net.max_clock_offset)
    if not serving:
        return
    reachable = judge_reachability([g.reachable for g in greetings if g.reachable is not None])
    if reachable is False:
        seen = ", ".join(sorted({g.seen_as for g in greetings if g.seen_as})) or "an unknown address"
        raise JoinError(
            f"the swarm cannot connect to this server: peers see it connect from {seen} but cannot open a "
            f"connection back to port(s) {', '.join(map(str, ports))}. A server must accept connections from "
            "trainers and its stage's replicas: it is behind a NAT or a firewall. Forward a port to it and "
            "set net.port to it and net.announce_addrs to the public address (e.g. --port 31337 --announce "
            "/ip4/PUBLIC_IP/tcp/31337), or run a trainer here instead (trainers work from behind a NAT)"
        )
