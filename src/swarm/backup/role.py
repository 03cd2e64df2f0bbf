"""`swarm backup`: a peer that serves no stage but holds a copy of every stage's state (see
`swarm.backup.keeper`), for swarms whose stages may lose all their replicas at once. It needs memory for
the whole model's parameters and optimizer state (`backup.max_mb` caps it) and a reachable address."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from swarm.backup.keeper import BackupKeeper
from swarm.config import SwarmConfig, config_hash
from swarm.exiting import STOP_MARGIN, on_stop_signals
from swarm.net.directory import short
from swarm.net.join import JoinServicer
from swarm.net.node import visible_addresses
from swarm.net.peer import join
from swarm.net.protocol import Traffic
from swarm.net.servicer import Reply, StageServicer
from swarm.results import PeerResults
from swarm.supervise import supervised
from swarm.wire.calls import StageQuery
from swarm.wire.validate import BadRequest, Unavailable

log = logging.getLogger("swarm.backup")


class CopiesOnly:
    """The stage protocol as a backup peer answers it: the `backup` call; every other is sent elsewhere."""

    def __init__(self, keeper: BackupKeeper, max_request_bytes: int):
        self.keeper = keeper
        self.max_request_bytes = max_request_bytes

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        log.warning("%s from %s refused: %s", method, short(caller), error.args[0])

    async def backup(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        return await self.keeper.serve(StageQuery.from_meta(meta).stage)

    async def _no_stage(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        raise Unavailable("a backup peer serves no stage")

    forward = backward = state = reduce = ledger = count = _no_stage


def run_backup_peer(cfg: SwarmConfig) -> None:
    asyncio.run(_serve(cfg))


async def _serve(cfg: SwarmConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    on_stop_signals(loop, stop.set, STOP_MARGIN, "backup peer")
    traffic = Traffic()
    peer = await join(cfg.net, cfg.wire, traffic, serving=True)
    keeper = BackupKeeper(peer.peer_id, config_hash(cfg), cfg.model, cfg.backup, cfg.net,
                          peer.client, peer.directory, lambda: None, every_stage=True)
    started = time.time()
    try:
        await JoinServicer(peer.p2p, peer.secret).add_p2p_handlers(peer.p2p)
        handler = CopiesOnly(keeper, int(cfg.net.max_payload_mb * 2**20))
        await StageServicer(handler, None, cfg.wire.policy(), traffic, secret=peer.secret).add_p2p_handlers(peer.p2p)
        log.info("backup peer %s up on %s: holding every stage's state, refreshed every %d steps",
                 short(peer.peer_id), " ".join(visible_addresses(peer.dht)), cfg.backup.every)
        keeping = asyncio.create_task(supervised("backup", keeper.loop))
        try:
            await peer.guard(stop.wait())
        finally:
            keeping.cancel()
    finally:
        PeerResults(cfg.run_dir).write(f"backup-{peer.peer_id[-8:]}.json", {
            "role": "backup", "peer_id": peer.peer_id, "alive_seconds": time.time() - started,
            "traffic": traffic.as_dict(), **keeper.summary(),
        }, indent=1)
        await peer.leave()
