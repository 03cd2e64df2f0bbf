"""A peer's DHT node on the peer's own event loop, its p2pd daemon shared with the peer's stage calls.

hivemind runs a DHT node in a child process of its own, and every read and store of the peer crosses a pipe
to it. Servers and trainers have an event loop anyway, so theirs runs there instead: one process fewer per
peer, and no pipe. At rest, with three servers and a trainer on two cores, those processes took 0.013-0.014
cores each (see BENCHMARKS.md), CPU a stage's compute could have had.

What moves onto the peer's loop: answering other nodes' reads and stores, checking the records they carry
(signatures), and this peer's own searches. A loop that lags past hivemind's `wait_timeout` (3 s) would make
other nodes pass this one over for a while, as they do any slow node; the servers' loop lag is watched and
reported (`swarm.looplag`). Tools without a loop of their own (the launcher's bootstrap, `swarm status`)
keep hivemind's process (`swarm.net.lifeline.TiedDHT`).

The daemon becomes the peer's own child. It goes in a process group of its own and is stopped when the
peer dies, as it was under the DHT process (see `swarm.net.lifeline`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase
from hivemind.p2p import P2P, PeerID

from swarm.net.lifeline import tied_daemon
from swarm.net.nearest import NearestStores

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

T = TypeVar("T")


class LoopDHT:
    """The part of `hivemind.DHT` a peer uses, served by a node on the calling loop: every call is a
    coroutine, whatever `return_future` says (the peer awaits them all)."""

    def __init__(self, node: DHTNode, p2p: P2P, identity: Ed25519PrivateKey):
        self.node, self.p2p = node, p2p
        self.identity = identity  # the peer's key: it signs receipts
        self.peer_id: PeerID = p2p.peer_id
        self._nearest = NearestStores(node)

    @classmethod
    async def create(cls, identity: Ed25519PrivateKey, *, client_mode: bool, initial_peers: Sequence[str],
                     record_validators: list[RecordValidatorBase], cache_nearest: int,
                     cache_refresh_before_expiry: float, **p2p_options: Any) -> LoopDHT:
        """Start the daemon, then the node joined through `initial_peers`; with the options `hivemind.DHT`
        takes, split between the two as hivemind splits them."""
        with tied_daemon(own_group=True):
            p2p = await P2P.create(initial_peers=initial_peers, dht_mode="client" if client_mode else "server",
                                   **p2p_options)
        try:
            node = await DHTNode.create(
                p2p=p2p, initial_peers=initial_peers, client_mode=client_mode,
                record_validator=CompositeValidator(record_validators), cache_nearest=cache_nearest,
                cache_refresh_before_expiry=cache_refresh_before_expiry)
        except BaseException:
            await p2p.shutdown()
            raise
        return cls(node, p2p, identity)

    async def get(self, key: Any, latest: bool = False, return_future: bool = True) -> Any:
        return await self.node.get(key, latest=latest)

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None,
                    return_future: bool = True) -> bool:
        """As `TiedDHT.store`: straight to the nodes last found nearest the key (`swarm.net.nearest`)."""
        return await self._nearest.store(key, value, expiration_time, subkey)

    async def run_coroutine(self, coro: Callable[[Any, DHTNode], Awaitable[T]], return_future: bool = True) -> T:
        return await coro(self, self.node)

    def gone(self) -> str | None:
        """Why this peer's network stack is gone (its daemon exited), or None while it lives."""
        daemon = self.p2p._child  # (hivemind's handle on the daemon it started)
        if daemon is None or daemon.returncode is None:
            return None
        return f"the p2pd daemon (pid {daemon.pid}) exited with code {daemon.returncode}"

    async def shutdown(self) -> None:
        """Stop answering other nodes, then close the daemon (which removes the sockets it was reached on:
        left behind, one file per peer that ever ran piles up in the temp directory)."""
        try:
            await self.node.shutdown()
        finally:
            await self.p2p.shutdown()
