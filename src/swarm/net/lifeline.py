"""A peer's helper processes tied to its life: hivemind runs the DHT in a child process, which starts the
p2pd daemon that carries every connection.

Two ways they used to go wrong. A signal sent to the peer's whole process group (Ctrl-C in a terminal,
`systemctl stop`, `kill -- -PGID`) reached the helpers as well, so they died while the peer was still
draining its work through them. And a SIGKILL of the peer left them running, answering in a dead peer's
name and keeping its connections open, so callers waited out their timeouts instead of seeing the
connection drop.

So the DHT process moves into a process group of its own (group signals stop at the peer, which shuts
its helpers down itself once drained), and each helper asks the kernel for a signal when its parent dies
(`PR_SET_PDEATHSIG`): the peer's death kills the DHT process, whose death stops p2pd.

Then the peer watches its helpers (`watch`): when the DHT process or the daemon is gone, or the daemon
stops answering, the peer cannot reach anyone any more and says so, instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import hivemind
from hivemind.p2p import P2P

from swarm.config import NetConfig
from swarm.net.dhtpipe import CallPipe
from swarm.net.nearest import NearestStores

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
PROBE_TIMEOUT = 5.0  # seconds the daemon has to answer one health probe
T = TypeVar("T")


class CutOff(RuntimeError):
    """This peer can no longer take part in the swarm: it exits with an error rather than wait forever."""


class NetworkLost(CutOff):
    """This peer's own network stack died (its DHT process or its p2pd daemon) or stopped answering."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when the thread that started it exits (Linux only;
    elsewhere helpers rely on the peer's orderly shutdown)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("could not tie a helper process to its parent: errno %d", ctypes.get_errno())


def _stop_with_parent() -> None:
    """p2pd's pre-exec hook: a Go daemon exits cleanly on SIGTERM."""
    die_with_parent(signal.SIGTERM)


class TiedDHT(hivemind.DHT):
    """hivemind's DHT process, in a process group of its own and killed when the peer dies. Its stores go
    straight to the nodes last found nearest their key (`swarm.net.nearest`); the peer's calls to it are
    answered over a pipe of their own (`swarm.net.dhtpipe`)."""

    identity: Ed25519PrivateKey | None = None  # the peer's key, kept by swarm.net.node.start_dht: it signs receipts
    _nearest: NearestStores | None = None  # (in the DHT's process, once its node runs)
    _calls: CallPipe | None = None

    def start(self) -> None:
        self._calls = CallPipe()
        super().start()
        self._calls.started()

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        if not self._piped():
            return super().get(key, latest, return_future, **kwargs)
        return self._call("_get", dict(key=key, latest=latest, **kwargs), return_future)

    def store(self, key, value, expiration_time: float, subkey=None, return_future: bool = False, **kwargs):
        if not self._piped():
            return super().store(key, value, expiration_time, subkey, return_future, **kwargs)
        return self._call("_store", dict(key=key, value=value, expiration_time=expiration_time, subkey=subkey,
                                         **kwargs), return_future)

    def run_coroutine(self, coro, return_future: bool = False):
        if not self._piped():
            return super().run_coroutine(coro, return_future)
        return self._call("_run_coroutine", dict(coro=coro), return_future)

    def _piped(self) -> bool:
        """Whether this call can take the pipe: made in the process that started the DHT, which reads it."""
        return self._calls is not None and self._calls.owner == os.getpid() and self._calls.reading

    def _call(self, method: str, kwargs: dict, return_future: bool) -> Any:
        call, reply = self._calls.open()
        self._outer_pipe.send((method, [], {**kwargs, "future": reply}))
        return call if return_future else call.result()

    def run(self) -> None:
        self._calls.serve()
        parent = os.getppid()
        os.setpgid(0, 0)
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:  # the peer died before the tie was made
            os._exit(1)
        spawn = asyncio.subprocess.create_subprocess_exec

        async def spawn_tied(*args, **kwargs):
            return await spawn(*args, preexec_fn=_stop_with_parent, **kwargs)

        # the p2pd daemon is started from this process alone, with hivemind's own call: tie it as well
        asyncio.subprocess.create_subprocess_exec = spawn_tied
        super().run()

    async def _store(self, key, value, expiration_time: float, subkey, future, **kwargs) -> None:
        """`store`, run in the DHT's process: by `NearestStores`, unless hivemind's own options are asked for."""
        if kwargs:
            return await super()._store(key, value, expiration_time, subkey, future, **kwargs)
        if self._nearest is None:
            self._nearest = NearestStores(self._node)
        try:
            stored = await self._nearest.store(key, value, expiration_time, subkey)
            if not future.done():
                future.set_result(stored)
        except BaseException as e:  # as hivemind's own: the caller's future carries every failure
            if not future.done():
                future.set_exception(e)


async def watch(dht: hivemind.DHT, p2p: P2P, every: float, timeout: float, misses: int) -> None:
    """Return only by raising `NetworkLost`: when the DHT process has exited, or the daemon has failed
    `misses` probes in a row (each given `timeout` seconds, one every `every`)."""
    failed = 0
    while True:
        await asyncio.sleep(every)
        if not dht.is_alive():
            raise NetworkLost(f"the DHT process (pid {dht.pid}) exited with code {dht.exitcode}")
        try:
            async with asyncio.timeout(timeout):  # (not wait_for, which can lose a cancellation on Python 3.11)
                await p2p.list_peers()
            failed = 0
        except Exception as e:  # any way a probe fails counts as a miss
            failed += 1
            if failed >= misses:
                raise NetworkLost(f"the p2pd daemon did not answer {failed} probes in a row "
                                  f"({type(e).__name__}: {e})") from e


async def guard(work: Awaitable[T], dht: hivemind.DHT, p2p: P2P, net: NetConfig, *watchers: Awaitable[None]) -> T:
    """`work`'s result, unless the network stack dies first (`NetworkLost`, after `net.health_misses`
    probes `net.health_every` apart) or another of `watchers` raises: `work` is then cancelled and that
    error raised, so the peer exits instead of waiting forever on a dead daemon."""
    work = asyncio.ensure_future(work)
    watching = [asyncio.ensure_future(w) for w in (
        watch(dht, p2p, net.health_every, PROBE_TIMEOUT, net.health_misses), *watchers)]
    try:
        pending = {work, *watching}
        while work in pending:  # a watcher that ends without an error (one switched off) watches no more
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [w.exception() for w in watching if w.done() and not w.cancelled() and w.exception()]
            if failed and not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise failed[0]
        return await work
    finally:
        for w in (work, *watching):
            w.cancel()
