"""A server entering a stage takes the stage's newest state: from a live replica further along, or, where
no replica is left, from the newest copy held outside the stage (`swarm.backup`) or its own checkpoint.

What it never does silently is serve the stage's initial weights mid-run: the stage's training would
restart from nothing while the others go on. It waits for a copy instead, saying so, unless its operator
allows a fresh start (`server.fresh_start`), which every peer then records (`ServerRecord.fresh`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from swarm.core.backups import Entry, plan_entry
from swarm.net.directory import Directory, short
from swarm.server.stage import ServedStage
from swarm.server.transfer import StateTransfer
from swarm.wire.records import BackupRecord

log = logging.getLogger("swarm.server")
RETRY_SECONDS = 2.0  # between looks, while the stage's dead replicas' records lapse or while waiting for a copy
NOT_SERVING = ("stage %d server %s is not serving: %s. Serving the initial weights would restart the stage's training "
               "from nothing while the other stages go on; waiting for a copy (start a `swarm backup` peer or a "
               "server that holds one), or restart this server with --fresh-stage to start the stage afresh")


async def take_stage_state(st: ServedStage, transfer: StateTransfer, directory: Directory, config_hash: str,
                           num_stages: int, fresh_allowed: bool, stop: asyncio.Event) -> bool:
    """Bring `st` (at its initial weights, or resumed from disk) to the stage's newest state; whether to
    serve it (False: stopped while waiting for a copy)."""
    waited = False
    seen = 0  # the newest epoch a look found the stage's replicas at
    while not stop.is_set():
        replicas = [r for r in await directory.stage(st.index)
                    if r.peer_id != st.peer_id and r.config_hash == config_hash]  # others' states do not fit
        seen = max([seen, *(r.epoch for r in replicas)])
        if replicas:  # a stage with live replicas: join them, taking their state if they are further along
            ahead = [r for r in replicas if r.epoch > st.runtime.epoch]
            if not ahead or await transfer.download(ahead):
                return True
            # none of those further along answered: they may have just died, their records not yet lapsed
        else:
            entry, newest_first = await _entry_without_replicas(st, directory, config_hash, num_stages,
                                                                fresh_allowed, seen)
            if entry.action == "restore":
                if await transfer.download(newest_first, method="backup"):
                    _record(st, entry, st.runtime.epoch)
                    transfer.note_restored(st.runtime.epoch)
                    return True
            elif entry.action == "wait":
                if not waited:
                    log.error(NOT_SERVING, st.index, st.label, entry.reason)
                    waited = True
            else:
                _record(st, entry, entry.epoch)
                if entry.action == "resume" or st.fresh:
                    transfer.note_restored(entry.epoch)
                return True
        try:
            async with asyncio.timeout(RETRY_SECONDS):  # (see Stepper.loop: wait_for can lose a cancellation)
                await stop.wait()
        except TimeoutError:
            pass
    return False


async def _entry_without_replicas(st: ServedStage, directory: Directory, config_hash: str, num_stages: int,
                                  fresh_allowed: bool, seen: int) -> tuple[Entry, list[BackupRecord]]:
    """What to do in a stage no replica is left of, and the copies newer than what `st` holds, newest first.
    `seen`: the newest epoch earlier looks found the stage's replicas at."""
    copies = [c for c in await directory.backups(st.index) if c.config_hash == config_hash]
    progressed = seen > 0 or await run_progressed(directory, num_stages, st.index)
    entry = plan_entry(st.runtime.epoch, [(c.peer_id, c.epoch, c.seen) for c in copies], progressed, fresh_allowed,
                       seen)
    return entry, sorted((c for c in copies if c.epoch > st.runtime.epoch), key=lambda c: -c.epoch)


def _record(st: ServedStage, entry: Entry, epoch: int) -> None:
    """Log the entry and keep it for the server's summary."""
    st.entry = {"action": entry.action, "epoch": epoch, "source": entry.source, "steps_lost": entry.lost,
                "time": time.time()}
    if entry.action == "restore":
        log.warning("stage %d server %s restored the stage from the copy held by %s at epoch %d: no replica was "
                    "left, and %d step(s) it had taken since are lost", st.index, st.label, short(entry.source),
                    epoch, entry.lost)
    elif entry.action == "resume" and entry.lost:
        log.warning("stage %d server %s serves its own checkpoint at epoch %d: no replica or newer copy was "
                    "left, and %d step(s) the stage had taken since are lost", st.index, st.label, epoch, entry.lost)
    elif entry.action == "fresh" and entry.reason != "the run is starting":
        st.fresh = time.time()
        log.warning("stage %d server %s starts the stage AFRESH from its initial weights mid-run (server.fresh_start"
                    "): its training so far is lost", st.index, st.label)


async def run_progressed(directory: Directory, num_stages: int, stage: int) -> bool:
    """Whether the run is past its start: another stage has stepped. (Samples trainers completed do not
    say so: every stage accumulates the same samples, so before any stage steps a stage whose replicas all
    died was still at its initial weights, which a fresh start gives back exactly.)"""
    layout: dict[int, Any] = await directory.stages(num_stages)
    return any(r.epoch > 0 for k, records in layout.items() if k != stage for r in records)
