"""Moves between stages (adaptive rebalancing): every server evaluates the same pure policy on the same
figures (`swarm.core.rebalance.plan_for_swarm`); the server it names drains its work here and moves.

Also where a newcomer with `--stage auto` goes: the stage with the least capacity."""

from __future__ import annotations

import asyncio
import logging
import time

from swarm.config import RebalanceConfig
from swarm.core import Move, Seat, capacities, choose_stage, layout_of, plan_for_swarm, still_planned
from swarm.net.directory import Directory
from swarm.results import PeerResults
from swarm.server.announcing import Announcer
from swarm.server.batching import Batcher
from swarm.server.gate import ComputeGate
from swarm.server.stage import ServedStage

log = logging.getLogger("swarm.server")


async def seats(directory: Directory, num_stages: int, config_hash: str, fresh: float = 0.0,
                in_transit: bool = False) -> list[Seat]:
    """Every live server of the run (with our settings) as the rebalancing policy sees it, from a read of
    this peer's up to `fresh` seconds old; with `in_transit`, also those between two stages, as moving
    from the one they left (the policy makes no move while one is under way)."""
    stages = await directory.stages(num_stages, fresh)
    moving = directory.in_transit(stages) if in_transit else []
    return [Seat(r.peer_id, r.stage, r.capacity, r.tenure, r.moving)
            for r in [*(r for records in stages.values() for r in records), *moving] if r.config_hash == config_hash]


async def least_served_stage(directory: Directory, num_stages: int, config_hash: str, label: str) -> int:
    """The stage with the least capacity now (the fewest servers among unmeasured ones)."""
    layout = layout_of(await seats(directory, num_stages, config_hash), num_stages)
    stage, caps = choose_stage(layout), capacities(layout)
    log.info("server %s joins stage %d, the one with the least capacity (samples/s by stage: %s)",
             label, stage, " ".join(f"{k}:{c:.1f}" for k, c in caps.items()))
    return stage


class Mover:
    def __init__(self, stage: ServedStage, peer_id: str, name: str, config_hash: str, num_stages: int,
                 rebalance: RebalanceConfig, leave_timeout: float, directory: Directory, gate: ComputeGate,
                 batcher: Batcher, announcer: Announcer, results: PeerResults, rng):
        self.stage = stage
        self.peer_id, self.name, self.hash = peer_id, name, config_hash
        self.num_stages = num_stages
        self.rc = rebalance
        self.leave_timeout = leave_timeout
        self.directory = directory
        self.gate, self.batcher, self.announcer = gate, batcher, announcer
        self.results = results
        self.rng = rng
        self.moved = asyncio.Event()  # set once this server drained its work and is ready to move

    async def _planned(self, fresh: float) -> tuple[Move, dict[int, float]] | None:
        """The move the policy makes now if it is this server's, with the stages' capacities, from a view
        of the stages up to `fresh` seconds old: none once the trainers are done (the run is ending; a read
        of the trainers up to a period old, the step loop's, tells) or while this server's own record is not
        in view (the view is then incomplete)."""
        trainers = await self.directory.trainers(fresh=self.rc.period)
        if not trainers or all(t.done for t in trainers):
            return None
        found = await seats(self.directory, self.num_stages, self.hash, fresh, in_transit=True)
        if self.peer_id not in {seat.peer for seat in found}:
            return None
        move = plan_for_swarm(found, self.num_stages, self.rc.min_gain, self.rc.cooldown)
        if move is None or move.peer != self.peer_id:
            return None
        return move, capacities(layout_of(found, self.num_stages))

    async def loop(self) -> None:
        """Look at the swarm's layout every period; when the policy names this server, look again after a
        random delay (another server may have acted meanwhile), then drain and move. The periodic look
        takes a read of the stages this peer made within the period (its backup keeper's, its trainer's
        view), if any: each read is served by every DHT node holding the keys, CPU taken from every host's
        compute. The second look reads anew."""
        while True:
            await asyncio.sleep(self.rc.period)
            try:
                if await self._planned(fresh=self.rc.period) is None:
                    continue
                await asyncio.sleep(self.rng.uniform(0.0, self.rc.jitter))
                planned = await self._planned(fresh=0.0)
                if planned is not None and await self._drain_for(*planned):
                    self.moved.set()
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a DHT lookup that failed: the next period looks again
                log.warning("rebalancing check failed: %s", e)

    async def _drain_for(self, move: Move, caps: dict[int, float]) -> bool:
        """Finish this stage's work before moving: trainers route new microbatches elsewhere (the record
        says `moving`, and new work is refused), the in-flight ones' backward passes are still served,
        and the stage's next step takes in the gradients this replica holds, so nothing is left to
        replay. Bounded by `server.leave_timeout`; what is still held then is dropped (and replayed by
        its trainers). False if the move is called off: no other server is left to serve the stage, or the
        layout changed meanwhile and the policy no longer makes this move (`still_planned`)."""
        st = self.stage
        started = time.monotonic()
        st.moving_to = move.target
        log.info("stage %d server %s moves to stage %d (samples/s by stage: %s; bottleneck %.1f -> %.1f "
                 "predicted); finishing its work here", st.index, st.label, move.target,
                 " ".join(f"{k}:{c:.1f}" for k, c in caps.items()), move.before, move.after)
        await self.announcer.announce()
        deadline = started + self.leave_timeout
        while time.monotonic() < deadline and (
            st.runtime.pending_samples or self.gate.queued or self.batcher.busy or st.runtime.graphs
        ):
            await asyncio.sleep(0.05)
        # from here on even backward passes go elsewhere (set without yielding to the loop in between:
        # a backward admitted before is counted in the gate's queue, so none can slip in unstepped)
        st.drained = True
        found = await seats(self.directory, self.num_stages, self.hash, in_transit=True)
        others = [seat for seat in found if seat.stage == st.index and seat.peer != self.peer_id and not seat.moving]
        if not others or not still_planned(found, move, self.num_stages, self.rc.min_gain, self.rc.cooldown):
            log.warning("stage %d server %s stays: %s", st.index, st.label, "no other server of the stage is left"
                        if not others else f"a move to stage {move.target} is no longer the plan")
            st.moving_to, st.drained = None, False
            await self.announcer.announce()
            return False
        self.results.append(f"moves-{self.peer_id[-8:]}.jsonl", {
            "time": time.time(), "peer_id": self.peer_id, "name": self.name, "source": move.source,
            "target": move.target, "before": move.before, "after": move.after, "capacities": caps,
            "drain_seconds": time.monotonic() - started, "held_samples": st.runtime.pending_samples,
        })
        return True
