"""One snapshot of a live swarm, read from the DHT: what `swarm status` prints and what a local
swarm's launcher (and the tests driving it) follow the run by.

The number of stages is learned from the servers themselves (each announces its model config) so that
an operator needs no config to look at a swarm; the configured count is where the search starts.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.config import ConfigError, SwarmConfig, replace
from swarm.core.health import Diagnosis, ServerFigures, diagnose
from swarm.net.directory import Directory, short
from swarm.net.node import start_dht
from swarm.wire.records import ServerRecord, TrainerRecord

MAX_STAGES = 256  # records are untrusted: a stage count beyond this is not believed (one DHT get per stage)


@dataclass
class SwarmStatus:
    servers: dict[int, list[ServerRecord]] = field(default_factory=dict)  # stage -> its live servers' records
    trainers: list[TrainerRecord] = field(default_factory=list)
    time: float = 0.0  # unix seconds when it was read

    @property
    def epochs(self) -> dict[int, list[int]]:
        """Stage -> the epoch of each live server."""
        return {stage: sorted(r.epoch for r in records) for stage, records in self.servers.items()}

    @property
    def pending_by_stage(self) -> dict[int, int]:
        """Stage -> samples accumulated, not yet stepped."""
        return {stage: sum(r.pending for r in records) for stage, records in self.servers.items()}

    @property
    def pending(self) -> int:
        return sum(self.pending_by_stage.values())

    @property
    def members(self) -> dict[int, list[str]]:
        """Stage -> the names (or peer ids) of its live servers."""
        return {stage: sorted(r.name or r.peer_id for r in records) for stage, records in self.servers.items()}

    @property
    def min_epoch(self) -> int:
        return min((min(e) for e in self.epochs.values() if e), default=0)

    @property
    def trainer_samples(self) -> int:
        return sum(t.completed for t in self.trainers)

    @property
    def loss(self) -> float:
        """The trainers' mean recent loss (NaN before any has one)."""
        losses = [t.loss for t in self.trainers if t.loss == t.loss]
        return sum(losses) / len(losses) if losses else float("nan")

    def diagnosis(self) -> Diagnosis:
        figures = {
            stage: [ServerFigures(label(r), server_rate(r), r.epoch, r.moving) for r in records]
            for stage, records in self.servers.items()
        }
        done = sum(t.done for t in self.trainers)
        return diagnose(figures, len(self.trainers) - done, done)


def label(record: ServerRecord) -> str:
    """How a server is named to a person: its operator's name, else its short peer id."""
    return record.name or short(record.peer_id)


def server_rate(record: ServerRecord) -> float:
    """A server's samples/s as rebalancing counts it: `capacity` (the long window); its recent
    `throughput` stands in until the first capacity figure is in."""
    return record.capacity or record.throughput


def announced_num_stages(servers: dict[int, list[ServerRecord]]) -> int | None:
    """The stage count most servers announce in their model config, if any announces a sensible one."""
    counts = Counter(
        n for records in servers.values() for r in records
        if isinstance(n := r.model.get("num_stages"), int) and not isinstance(n, bool) and 0 < n <= MAX_STAGES
    )
    return counts.most_common(1)[0][0] if counts else None


async def read_status(directory: Directory, num_stages: int) -> SwarmStatus:
    """The swarm as the DHT shows it now: `num_stages` (from the config) is corrected by what the
    servers announce, so a stage beyond it is read too and a phantom one dropped."""
    servers = await directory.stages(num_stages)
    announced = announced_num_stages(servers)
    if announced is not None and announced != num_stages:
        servers = {k: servers[k] if k in servers else await directory.stage(k) for k in range(announced)}
    return SwarmStatus(servers, await directory.trainers(), time.time())


def follow(cfg: SwarmConfig, show: Callable[[SwarmStatus], None], every: float | None = None) -> None:
    """Join the swarm's DHT as a client (reachable by no one, on a port of its own), `show` a snapshot,
    and with `every` another one every `every` seconds until interrupted; leave the DHT in every case.
    Raises `swarm.net.node.JoinError` when no initial peer answers."""
    if not cfg.net.initial_peers:
        raise ConfigError("net.initial_peers: give --initial-peers (the addresses `swarm dht` prints)")
    dht = start_dht(replace(cfg, net={"port": 0}).net, client_mode=True)
    try:
        asyncio.run(_follow(Directory(dht, cfg.net.run_id, cfg.net.record_ttl), cfg.model.num_stages, show, every))
    finally:
        dht.shutdown()


async def _follow(directory: Directory, num_stages: int, show: Callable[[SwarmStatus], None],
                  every: float | None) -> None:
    while True:
        status = await read_status(directory, num_stages)
        show(status)
        # the swarm's shape, once learned, outlives a read in which no server's record came through
        num_stages = announced_num_stages(status.servers) or num_stages
        if every is None:
            return
        await asyncio.sleep(every)
