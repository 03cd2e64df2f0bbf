"""A stage's state moving in and out of a replica: downloaded from a replica further along (catching up,
or entering a stage), written to and resumed from checkpoints on disk."""

from __future__ import annotations

import asyncio
import logging
import time

from swarm.net.directory import short
from swarm.net.transport import CallFailed, StageClient
from swarm.results import PeerResults
from swarm.server.gate import ComputeGate
from swarm.server.stage import ServedStage
from swarm.wire.records import ServerRecord

log = logging.getLogger("swarm.server")
UNUSABLE = (KeyError, TypeError, ValueError, RuntimeError)  # how a state that does not fit the stage fails


class StateTransfer:
    def __init__(self, stage: ServedStage, gate: ComputeGate, client: StageClient, results: PeerResults,
                 results_name: str, timeout: float):
        self.stage = stage
        self.gate = gate
        self.client = client
        self.results, self.loads_file = results, f"{results_name}.loads.jsonl"
        self.timeout = timeout

    async def download(self, candidates: list[ServerRecord], force: bool = False) -> bool:
        """Load parameters and optimizer state from the most advanced replica that answers (with `force`,
        one at our own epoch too); whether one was loaded."""
        st = self.stage
        for source in sorted(candidates, key=lambda r: -r.epoch):
            try:
                meta, tensors = await self.client.call(source.peer_id, "state", {"stage": st.index}, [], self.timeout)
            except CallFailed as e:
                log.warning("state download from %s failed: %s", short(source.peer_id), e)
                continue
            async with self.gate.lock:
                if int(meta.get("epoch", -1)) < st.runtime.epoch + (0 if force else 1):
                    return False
                lost = st.runtime.pending_samples
                try:
                    await self.gate.run_locked(st.runtime.load_state, meta, tensors)
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
            log.info("stage %d server %s loaded epoch %d from %s%s", st.index, st.label, st.runtime.epoch,
                     short(source.peer_id), f" (dropped {lost} samples computed at older weights)" if lost else "")
            return True
        return False

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
