"""A stage's state moving in and out of a replica: downloaded from a replica further along (catching up,
or entering a stage), written to and resumed from checkpoints on disk."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swarm.net.directory import Directory, short
from swarm.net.transport import CallFailed, StageClient
from swarm.results import PeerResults
from swarm.server.gate import ComputeGate
from swarm.server.stage import ServedStage
from swarm.wire.calls import StageQuery
from swarm.wire.records import BackupRecord, ServerRecord

log = logging.getLogger("swarm.server")
Reply = tuple[dict[str, Any], list[torch.Tensor]]
UNUSABLE = (KeyError, TypeError, ValueError, RuntimeError)  # how a state that does not fit the stage fails


class StateTransfer:
    def __init__(self, stage: ServedStage, gate: ComputeGate, client: StageClient, directory: Directory,
                 config_hash: str, results: PeerResults, results_name: str, timeout: float, announce_period: float,
                 local_copy: Callable[[int], Reply | None]):
        """`local_copy`: this peer's own copy of a stage, if it holds one (a server that moves into a stage
        it held the copy of takes it from itself)."""
        self.stage = stage
        self.gate = gate
        self.client = client
        self.directory, self.hash = directory, config_hash
        self.results, self.loads_file = results, f"{results_name}.loads.jsonl"
        self.timeout = timeout
        self.announce_period = announce_period
        self.local_copy = local_copy
        self.unvouched: set[str] = set()  # the sources whose state the last download refused as unvouched

    async def download(self, candidates: Sequence[ServerRecord | BackupRecord], force: bool = False,
                       method: str = "state") -> bool:
        """Load parameters and optimizer state from the most advanced replica that answers with a state
        the stage's replicas vouch for (`_vouched`; with `force`, one at our own epoch too), or with
        `method="backup"` from a copy held outside the stage (its holder took it only once vouched for);
        whether one was loaded."""
        st = self.stage
        self.unvouched = set()
        for source in sorted(candidates, key=lambda r: -r.epoch):
            try:
                meta, tensors = await self._fetch(source.peer_id, method)
            except CallFailed as e:
                log.warning("state download from %s failed: %s", short(source.peer_id), e)
                continue
            epoch = meta.get("epoch")
            if not isinstance(epoch, int) or isinstance(epoch, bool):
                log.warning("state from %s is unusable: epoch %r", short(source.peer_id), epoch)
                continue
            if method == "state" and not await self._vouched(source.peer_id, meta, candidates):
                continue
            async with self.gate.lock.urgent():  # (catching up: see swarm.server.turns)
                if epoch < st.runtime.epoch + (0 if force else 1):
                    return False
                try:
                    lost = await self.gate.run_locked(st.runtime.load_state, meta, tensors)
                except UNUSABLE as e:
                    log.warning("state from %s is unusable: %s", short(source.peer_id), e)
                    continue
            st.counters["catch_ups"] += 1
            st.counters["lost_samples"] += lost
            # the steps this replica logged before are superseded by the ones it loaded
            self.results.append(self.loads_file, {"time": time.time(), "epoch": st.runtime.epoch,
                                                  "source": source.peer_id})
            if st.checkpoints is None:
                st.durable_epoch = st.runtime.epoch  # the source holds it too
            kept = st.runtime.pending_samples
            log.info("stage %d server %s loaded epoch %d from %s%s%s", st.index, st.label, st.runtime.epoch,
                     short(source.peer_id), f" (dropped {lost} samples computed at older weights)" if lost else "",
                     f" (kept {kept} samples held, one step old, for the next step)" if kept else "")
            return True
        return False

    async def _vouched(self, source: str, meta: dict[str, Any],
                       known: Sequence[ServerRecord | BackupRecord]) -> bool:
        """Whether the stage's other replicas vouch for the state `source` served (swarm.core.vouching); a
        source they do not vouch for is noted in `unvouched`."""
        records = [r for r in known if isinstance(r, ServerRecord)]
        if await self.directory.vouch(self.stage.index, self.hash, self.stage.peer_id, source, meta, records,
                                      self.announce_period):
            return True
        self.unvouched.add(source)
        return False

    async def _fetch(self, peer: str, method: str) -> Reply:
        if peer == self.stage.peer_id:
            found = self.local_copy(self.stage.index) if method == "backup" else None
            if found is None:
                raise CallFailed("no copy of the stage held here")
            return found
        query = StageQuery(self.stage.index, joining=method == "state")
        return await self.client.call(peer, method, query.to_meta(), [], self.timeout)

    def note_restored(self, epoch: int) -> None:
        """The stage lost every replica and goes on from `epoch`: the steps its replicas took beyond it
        before now are a branch of its history that is lost (see `swarm.ops.report.read_steps`)."""
        self.results.append(self.loads_file, {"time": time.time(), "epoch": epoch, "restored": True})

    async def checkpoint(self) -> None:
        st = self.stage
        meta, tensors = await self.gate.run(st.runtime.state)
        path = await asyncio.get_running_loop().run_in_executor(None, st.checkpoints.save, meta, tensors)
        st.durable_epoch = max(st.durable_epoch, int(meta["epoch"]))
        log.info("stage %d checkpoint at epoch %d: %s", st.index, meta["epoch"], path)

    def resume_from_disk(self) -> None:
        st = self.stage
        found = st.checkpoints.latest() if st.checkpoints is not None else None
        if found is None:
            return
        meta, tensors = found
        try:
            st.runtime.load_state(meta, tensors)
        except UNUSABLE as e:
            log.warning("stage %d checkpoint at epoch %s is unusable (%s); starting without it",
                        st.index, meta.get("epoch"), e)
            return
        st.durable_epoch = st.runtime.epoch
        log.info("stage %d resumed from checkpoint at epoch %d", st.index, st.runtime.epoch)
