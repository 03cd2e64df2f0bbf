"""A swarm's first peer: a DHT node others join through, which greets newcomers (`swarm.net.join`).

`swarm dht` runs one as a process of its own, for a swarm spread over machines. A launcher that starts a
whole swarm on one machine (`swarm local`, the benchmarks) runs it in its own process instead
(`Bootstrap`): one process fewer to start before any server can, and its DHT node doubles as the one
the launcher reads the swarm's records through.
"""

from __future__ import annotations

import asyncio
import threading

import hivemind
from hivemind.p2p import P2P

from swarm.config import NetConfig
from swarm.net.join import JoinServicer
from swarm.net.node import check_join, start_dht, visible_addresses
from swarm.net.secret import load_secret

READY_TIMEOUT = 60.0  # seconds a bootstrap started in a launcher has to open its greeting service


async def open_bootstrap(dht: hivemind.DHT, net: NetConfig) -> P2P:
    """Greet the swarm's other initial peers, if any, and answer newcomers' greetings from now on: the
    peer's connection, to be kept while it serves."""
    p2p = await dht.replicate_p2p()
    secret = load_secret(net.secret_path)
    await check_join(dht, p2p, net, serving=False, secret=secret)
    await JoinServicer(p2p, secret).add_p2p_handlers(p2p)
    return p2p


class Bootstrap:
    """A bootstrap peer inside the calling process: its DHT node runs in hivemind's child process (tied to
    this one's life), its greeting service on an event loop in a thread of its own, as the launcher's
    main thread runs no loop between starting peers and following them. Start it from the main thread."""

    def __init__(self, net: NetConfig):
        self.dht = start_dht(net)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(net),), name="bootstrap", daemon=True)
        self._thread.start()
        if not self._ready.wait(READY_TIMEOUT) or self._failure is not None:
            self.shutdown()
            raise RuntimeError(f"the bootstrap peer did not come up: {self._failure or 'timed out'}")
        self.addresses = visible_addresses(self.dht)

    async def _serve(self, net: NetConfig) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            await open_bootstrap(self.dht, net)
        except Exception as e:  # reported by the constructor, which waits for this
            self._failure = e
            return
        finally:
            self._ready.set()
        await self._stop.wait()

    def shutdown(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)
        self.dht.shutdown()
