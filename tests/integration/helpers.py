"""Shared pieces of the integration tests: a small swarm config and reading state off live servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from swarm.config import SwarmConfig, config_hash, load_config
from swarm.net.directory import Directory
from swarm.net.node import start_dht
from swarm.net.transport import StageClient


def small_config(run_dir: Path, *extra: str) -> SwarmConfig:
    """2 stages x 2 servers, 2 trainers, a model small enough that a step takes well under a second."""
    return load_config(
        overrides=[
            f'run_dir="{run_dir}"',
            'net.run_id="itest"',
            "net.allreduce_timeout=8.0",
            "model.d_model=64", "model.n_heads=2", "model.d_ff=128", "model.n_layers=2", "model.seq_len=64",
            "model.num_stages=2",
            "optim.lr=3e-3", "optim.warmup_steps=2", "optim.target_batch_size=16",
            "trainer.microbatch_size=4", "trainer.max_inflight=3", "trainer.target_steps=8",
            "trainer.request_timeout=10.0", "trainer.ban_seconds=3.0",
            "local.servers_per_stage=2", "local.trainers=2", "local.timeout=240.0",
            *extra,
        ]
    )


def fetch_stage_states(cfg: SwarmConfig, initial_peers: tuple[str, ...], stage: int) -> dict[str, list[torch.Tensor]]:
    """Download every live replica's parameters of one stage, keyed by peer id."""

    async def fetch() -> dict[str, list[torch.Tensor]]:
        net = load_config(overrides=[f"net.initial_peers={list(initial_peers)!r}".replace("'", '"')]).net
        dht = start_dht(net, client_mode=True)
        try:
            client = StageClient(await dht.replicate_p2p())
            records = await Directory(dht, cfg.net.run_id, cfg.net.record_ttl).stage(stage)
            states = {}
            for r in records:
                meta, tensors = await client.call(
                    r.peer_id, "state", {"stage": stage, "config": config_hash(cfg.model)}, [], 30.0
                )
                states[r.peer_id] = tensors[: len(meta["names"])]
            return states
        finally:
            dht.shutdown()

    return asyncio.run(fetch())


def tracebacks(run_dir: Path) -> dict[str, str]:
    """Log files that contain a Python traceback, with the text around it."""
    found = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            found[log.name] = text[text.index("Traceback") - 200 :][:2000]
    return found
