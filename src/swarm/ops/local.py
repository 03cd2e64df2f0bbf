"""A whole swarm on this machine: a bootstrap peer, stage servers and trainers, each its own process.

Each peer runs in its own process group, so that killing one (as a vanished machine would) can
take down its whole group: hivemind's DHT child and p2pd daemon outlive a SIGKILL of the main
process alone and would keep answering in its name. Not in a session of its own: where the kernel
groups processes by session for scheduling (autogroup), each peer would get an equal share of the
cores, its helpers' work taken from its own compute thread alone, and the stage with the busiest
helpers would hold back the pipeline while the other stages' cores stood idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from swarm.config import ConfigError, SwarmConfig, replace, to_toml
from swarm.net.bootstrap import Bootstrap
from swarm.net.directory import Directory
from swarm.ops import netlab
from swarm.ops.cpushare import CpuShare
from swarm.ops.netlab import Host, NetLab
from swarm.ops.pinning import Cores, core_sets, free_set
from swarm.ops.procs import signal_machine
from swarm.ops.status import SwarmStatus, read_status

log = logging.getLogger("swarm.local")
TICK = 0.5  # seconds between checks of the peers' processes
FOLLOW_EVERY = 5.0  # seconds between looks at a plain run's DHT records while its trainers train


@dataclass
class Peer:
    name: str
    role: str
    process: subprocess.Popen
    log_path: Path
    stage: int | None = None
    host: Host | None = None  # the network namespace it runs in, if any
    metrics_port: int = 0  # where its Prometheus /metrics is served (0: nowhere)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(text[-lines:])

    def signal(self, sig: int) -> None:
        """Signal the peer's whole process group; a peer already gone is not an error."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def fault_file(run_dir: Path, peer_name: str) -> Path:
    """Where a local peer reads the message delay/loss rules a fault injector sets for it."""
    return Path(run_dir) / "faults" / f"{peer_name}.json"


def start_layout(cfg: SwarmConfig) -> tuple[int, ...]:
    """How many servers a local swarm starts for each stage."""
    return cfg.local.layout or (cfg.local.servers_per_stage,) * cfg.model.num_stages


class LocalSwarm:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.peers: list[Peer] = []
        self._counted_ports = 0  # metrics ports handed out from net.metrics_port
        self.initial_peers: tuple[str, ...] = ()
        self._counter = 0
        self.lab: NetLab | None = None
        self.bootstrap: Bootstrap | None = None
        self.shares: list[CpuShare] = []
        self.hosted: dict[int, Peer] = {}  # trainer index -> the server whose process runs it (`server.train`)
        self.core_sets: list[Cores] = []  # the servers' compute cores, where the launch pins them
        self.pinned: dict[str, Cores] = {}  # server name -> the cores its compute thread is kept on

    # ---- starting peers ----------------------------------------------------------------------

    def _spawn(
        self,
        role: str,
        name: str,
        overrides: list[str],
        stage: int | None = None,
        host: Host | None = None,
        slowdown: float = 1.0,
    ) -> Peer:
        """Start one peer in its own process group (inside `host`'s network namespace, if given); a server
        held to a CPU share gets `slowdown` times less of it."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        threads = str(self.cfg.local.threads_per_peer)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        if self.cfg.local.daemon_threads:  # (the p2p daemons the peer starts inherit its environment)
            env["GOMAXPROCS"] = str(self.cfg.local.daemon_threads)
        wrap = netlab.wrap(host) if host else ()
        cmd = [*wrap, sys.executable, "-m", "swarm.cli.main", role, "--config", str(self.run_dir / "config.toml")]
        # a fault injector may delay or drop this peer's messages through this file
        overrides = [*overrides, f'net.fault_file="{fault_file(self.run_dir, name)}"']
        given = [o.partition("=")[2] for o in overrides if o.startswith("net.metrics_port=")]
        metrics_port = int(given[-1]) if given else 0
        if not given and self.cfg.net.metrics_port and role in ("server", "trainer"):
            # peers share the host: each takes its own port, counting up from the configured one
            metrics_port = self.cfg.net.metrics_port + self._counted_ports
            self._counted_ports += 1
            overrides = [*overrides, f"net.metrics_port={metrics_port}"]
        for o in overrides:
            cmd += ["--set", o]
        share = None
        if role == "server" and self.cfg.local.server_cpus:
            share = CpuShare(f"swarm-{os.getpid()}-{name}", self.cfg.local.server_cpus / slowdown)
            self.shares.append(share)
        with open(log_path, "ab") as out:
            process = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0,
                stdin=subprocess.DEVNULL, preexec_fn=share.enter if share else None,
            )
        peer = Peer(name, role, process, log_path, stage, host, metrics_port)
        self.peers.append(peer)
        self._write_registry()
        return peer

    def _write_registry(self) -> None:
        """peers.json: every peer's pid and namespace, for `swarm fault` run from another terminal."""
        registry = {
            p.name: {"role": p.role, "stage": p.stage, "pid": p.process.pid, "host": p.host and asdict(p.host),
                     "metrics_port": p.metrics_port}
            for p in self.peers
        }
        (self.run_dir / "peers.json").write_text(json.dumps(registry, indent=1))

    def start(self) -> None:
        self.start_servers()
        if self.cfg.local.trainers_wait:
            asyncio.run(self.wait_for_servers())
        for index in range(0 if self.cfg.local.trainers_in_servers else self.cfg.local.trainers):
            self.add_trainer(index)

    def start_servers(self) -> None:
        """The bootstrap peer and `local.layout`'s servers (with their trainers, where those run inside them)."""
        loc = self.cfg.local
        layout = start_layout(self.cfg)
        if loc.trainers_in_servers and loc.trainers > sum(layout):
            raise ConfigError(f"local.trainers: {loc.trainers} inside servers need as many servers, not {sum(layout)}")
        self.start_bootstrap()
        self._plan_cores(sum(layout))
        slowdowns, delays = iter(loc.slowdowns), iter(loc.reply_delays)
        hosted = iter(range(loc.trainers if loc.trainers_in_servers else 0))
        for stage, count in enumerate(layout):
            for _ in range(count):
                slowdown, delay = next(slowdowns, 1.0), next(delays, 0.0)
                # held to a CPU share, a slower machine is a smaller share; else the server idles itself
                slowed = slowdown != 1.0 and not loc.server_cpus
                overrides = ((f"server.slowdown={slowdown}",) if slowed else ()) + (
                    (f"server.reply_delay={delay}",) if delay else ())
                if (index := next(hosted, None)) is not None:
                    overrides += ("server.train=true", f"trainer.index={index}")
                server = self.add_server(stage, overrides, slowdown=slowdown)
                if index is not None:
                    self.hosted[index] = server

    def start_bootstrap(self) -> None:
        for stale in ("peers", "logs"):  # a run directory reused by a new run must not mix in the old one
            shutil.rmtree(self.run_dir / stale, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.local.netns:  # peers outside the namespaces listen where the namespaces reach them
            self.lab = NetLab(1 + os.getpid() % 250)
            self.cfg = replace(self.cfg, net={"host": self.lab.gateway})
        else:  # one host: every peer on loopback, reachable from this machine only
            self.cfg = replace(self.cfg, net={"host": "127.0.0.1"})
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
        self.bootstrap = Bootstrap(self.cfg.net)  # in this process: no peer waits for one to start
        self.initial_peers = tuple(self.bootstrap.addresses)

    def _plan_cores(self, servers: int) -> None:
        loc = self.cfg.local
        # (a GPU server's compute thread launches kernels: what pinning saves a CPU server, it does not)
        if not (loc.pin_compute and self.cfg.server.device == "cpu" and hasattr(os, "sched_getaffinity")):
            return
        available = os.sched_getaffinity(0)
        self.core_sets = core_sets(available, servers, loc.threads_per_peer)
        if self.core_sets:
            log.info("each server's compute on cores of its own: %s",
                     " ".join(",".join(map(str, cores)) for cores in self.core_sets))
        else:
            log.info("servers' compute not pinned: %d servers x %d threads, %d cores", servers,
                     loc.threads_per_peer, len(available))

    def _free_cores(self) -> Cores | None:
        held = {self.pinned[p.name] for p in self.peers if p.name in self.pinned and p.process.poll() is None}
        return free_set(self.core_sets, held)

    def _peers_override(self) -> str:
        return "net.initial_peers=[" + ",".join(f'"{a}"' for a in self.initial_peers) + "]"

    def add_server(self, stage: int, overrides: tuple[str, ...] = (), namespace: bool | None = None,
                   slowdown: float = 1.0) -> Peer:
        """A server of `stage`; on a namespace host of its own if `namespace` (default: `local.netns`)."""
        self._counter += 1
        name = f"server-s{stage}-{self._counter}"
        args = [self._peers_override(), f"server.stage={stage}", f'server.name="{name}"']
        cores = None if any(o.startswith("server.compute_cores=") for o in overrides) else self._free_cores()
        if cores is not None:
            args.append(f"server.compute_cores={list(cores)}")
            self.pinned[name] = cores
        args += overrides
        host = None
        if self.cfg.local.netns if namespace is None else namespace:
            host = self._host(name)
            args.append(f'net.host="{host.ip}"')
        return self._spawn("server", name, args, stage, host=host, slowdown=slowdown)

    def add_trainer(self, index: int, overrides: tuple[str, ...] = ()) -> Peer:
        name = f"trainer-{index}"
        overrides = [self._peers_override(), f"trainer.index={index}", *overrides]
        host = self._host(name) if self.cfg.local.netns else None
        if host is not None:
            overrides.append(f'net.host="{host.ip}"')
        return self._spawn("trainer", name, overrides, host=host)

    def add_backup(self) -> Peer:
        """A `swarm backup` peer: it holds a copy of every stage's state (see swarm.backup)."""
        self._counter += 1
        name = f"backup-{self._counter}"
        host = self._host(name) if self.cfg.local.netns else None
        overrides = [self._peers_override(), *([f'net.host="{host.ip}"'] if host is not None else [])]
        return self._spawn("backup", name, overrides, host=host)

    def _host(self, name: str) -> Host:
        """A namespace host of its own for a peer, its link shaped to `local.link_mbit` if that is set."""
        if self.lab is None:
            raise ValueError("peers go on namespace hosts only in a swarm started with local.netns = true")
        host = self.lab.add_host(name)
        if self.cfg.local.link_mbit:
            netlab.shape(host, self.cfg.local.link_mbit)
        return host

    def servers(self, stage: int | None = None) -> list[Peer]:
        """Live servers (of the stage they were started for, if `stage` is given)."""
        return [p for p in self.peers if p.role == "server" and p.alive() and (stage is None or p.stage == stage)]

    def serving(self, status: SwarmStatus, stage: int) -> list[Peer]:
        """The live servers that serve `stage` now, as the DHT shows them (servers move between stages)."""
        names = set(status.members.get(stage, []))
        return [p for p in self.servers() if p.name in names]

    def trainers(self) -> list[Peer]:
        return [p for p in self.peers if p.role == "trainer"]

    def _trained(self, index: int) -> bool:
        """Whether the trainer of that index, inside a server's process, is over: it wrote its summary."""
        return any((self.run_dir / "peers").glob(f"trainer-{index}-*.json"))

    def _wait(self, condition, timeout: float, what: str, peer: Peer | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if peer is not None and not peer.alive():
                raise RuntimeError(f"{what} exited early; {peer.log_path} ends with:\n{peer.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not come up within {timeout:.0f}s")
            time.sleep(0.1)

    # ---- watching the run --------------------------------------------------------------------

    def wait_until_done(
        self, progress: bool = True, on_status: Callable[[SwarmStatus], bool | None] | None = None
    ) -> SwarmStatus:
        """Block until the run is over; `on_status` sees every poll (tests inject faults from it) until it
        returns true: the run is then looked at as a plain one is, less often."""
        return asyncio.run(self._watch(progress, on_status))

    def _directory(self) -> Directory:
        """The swarm's directory, read through the DHT node of its bootstrap peer (in this process)."""
        if self.bootstrap is None:
            raise RuntimeError("the local swarm has not been started")
        return Directory(self.bootstrap.dht, self.cfg.net.run_id, self.cfg.net.record_ttl)

    async def wait_for_servers(self) -> None:
        """Until every server launched so far has announced itself (`local.trainers_wait`)."""
        launched = self.servers()
        deadline, directory = time.monotonic() + self.cfg.local.timeout, self._directory()
        while True:
            status = await read_status(directory, self.cfg.model.num_stages)
            up = {name for names in status.members.values() for name in names}
            if all(p.name in up for p in launched):
                return
            for p in launched:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited early; {p.log_path} ends with:\n{p.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers not up within {self.cfg.local.timeout:.0f}s: "
                                   + ", ".join(p.name for p in launched if p.name not in up))
            await asyncio.sleep(0.5)

    async def _watch(self, progress: bool, on_status: Callable[[SwarmStatus], bool | None] | None) -> SwarmStatus:
        """Follow the run until every trainer finished and every stage flushed its last samples."""
        return await self._follow(self._directory(), progress, on_status)

    async def _follow(self, directory: Directory, progress: bool,
                      on_status: Callable[[SwarmStatus], bool | None] | None) -> SwarmStatus:
        target = self.cfg.trainer.target_steps
        bar = tqdm(total=target, desc="steps", unit="step", disable=not progress, dynamic_ncols=True)
        deadline = time.monotonic() + self.cfg.local.timeout
        started, status, looked = time.monotonic(), SwarmStatus(), -math.inf
        try:
            while True:
                await asyncio.sleep(TICK)
                trainers_over = self._trainers_over()
                # a look reads every stage's and trainer's records from the DHT nodes, the servers (CPU taken from
                # their compute): a plain run is looked at every FOLLOW_EVERY while it trains, and at every tick
                # (as a fault script sees it) once its trainers are over, to end as soon as the stages flushed.
                if on_status is None and not trainers_over and time.monotonic() - looked < FOLLOW_EVERY:
                    continue
                looked = time.monotonic()
                status = await read_status(directory, self.cfg.model.num_stages)
                if on_status is not None and on_status(status):
                    on_status = None
                bar.update(max(0, min(status.min_epoch, target) - bar.n))
                rate = status.trainer_samples / max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(
                    f"loss {status.loss:.3f} | {rate:.1f} samples/s | servers/stage "
                    + "/".join(str(len(status.epochs.get(k, []))) for k in range(self.cfg.model.num_stages))
                )
                stages_even = all(len(set(e)) == 1 for e in status.epochs.values() if e)
                if trainers_over and status.pending == 0 and stages_even:
                    return status
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run did not finish within {self.cfg.local.timeout:.0f}s")
        finally:
            bar.close()

    def _trainers_over(self) -> bool:
        """Whether every trainer is over (one inside a server: it wrote its summary); raises if one failed."""
        for p in [*self.trainers(), *self.hosted.values()]:  # (SIGKILL: a machine vanished, the others go on)
            if p.process.poll() not in (None, 0, -signal.SIGKILL):
                code, tail = p.process.returncode, p.log_tail()
                raise RuntimeError(f"{p.name} failed (exit code {code}); {p.log_path} ends with:\n{tail}")
        return all(not p.alive() for p in self.trainers()) and all(
            not p.alive() or self._trained(index) for index, p in self.hosted.items())

    # ---- stopping ----------------------------------------------------------------------------

    def stop(self, grace: float = 30.0) -> None:
        """SIGINT every peer's main process (it leaves cleanly, reaping its DHT child and p2pd), then
        SIGKILL whatever lingers."""
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not abort the cleanup
        try:
            self._stop(grace)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _stop(self, grace: float) -> None:
        for p in self.peers:
            if p.alive():
                os.kill(p.process.pid, signal.SIGINT)
        deadline = time.monotonic() + grace
        for p in self.peers:
            try:
                p.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit in time; killing it", p.name)
        for p in self.peers:
            signal_machine(p.process.pid, signal.SIGKILL)  # whatever lingers, helpers included
            p.process.wait()
        for share in self.shares:
            share.close()
        if self.bootstrap is not None:
            self.bootstrap.shutdown()
            self.bootstrap = None
        if self.lab is not None:
            self.lab.close()

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
