"""`swarm demo` / `swarm local`: launch, follow, stop, report."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.config import SwarmConfig
from swarm.ops.local import LocalSwarm, start_layout
from swarm.ops.report import write_report
from swarm.ops.status import SwarmStatus

log = logging.getLogger("swarm.local")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_local(cfg: SwarmConfig, progress: bool = True,
              on_status: Callable[[LocalSwarm, SwarmStatus], bool | None] | None = None) -> dict[str, Any]:
    """Run a local swarm to its end and report; `on_status` sees the swarm at every look (a benchmark
    ends a peer from it) until it returns true (see `LocalSwarm.wait_until_done`)."""
    m, loc = cfg.model, cfg.local
    layout = start_layout(cfg)
    log.info(
        "local swarm: %d stages with %s servers, %d trainers, %d steps of %d samples, rebalancing %s; logs in %s/logs",
        m.num_stages, "/".join(map(str, layout)), loc.trainers, cfg.trainer.target_steps,
        cfg.optim.target_batch_size, "on" if cfg.rebalance.enabled else "off", cfg.run_dir,
    )
    swarm = LocalSwarm(cfg)
    # a terminated launcher must not leave its peers behind: they run in process groups of their own
    signal.signal(signal.SIGTERM, _interrupt)
    with swarm:
        swarm.wait_until_done(progress=progress,
                              on_status=None if on_status is None else lambda status: on_status(swarm, status))
    summary = write_report(Path(cfg.run_dir))
    log.info(
        "done: %d samples in %.0fs (%.1f samples/s), loss %.3f -> %.3f; see %s/summary.json, loss.png, throughput.png",
        summary["samples_completed"], summary["wall_seconds"] or 0, summary["samples_per_second"] or 0,
        summary["first_loss"] or 0, summary["final_loss"] or 0, cfg.run_dir,
    )
    return summary
