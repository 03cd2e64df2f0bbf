"""Named recipes: partial configs for common runs, applied under the user's file and overrides."""

from __future__ import annotations

from typing import Any

# `swarm demo`: 3 stages x 2 servers and 2 trainers on one 2-core machine, loss falling within minutes.
DEMO: dict[str, Any] = {
    "run_dir": "runs/demo",
    "model": {"d_model": 128, "n_heads": 4, "d_ff": 512, "n_layers": 6, "seq_len": 128, "num_stages": 3},
    "optim": {"lr": 1e-3, "warmup_steps": 5, "target_batch_size": 32},
    "trainer": {"microbatch_size": 4, "max_inflight": 4, "target_steps": 80},
    "local": {"servers_per_stage": 2, "trainers": 2, "threads_per_peer": 1, "timeout": 900.0},
}

# How a stage's replicas learn together, as compared by experiments/asynchrony.py: synchronous SWARM,
# async SWARM with AdamW local updates ("SWARM-Async"), and async with NAG weight correction. A run's
# configuration plus one of these differs from the same run plus another in these fields only.
TRAINING_MODES: dict[str, dict[str, Any]] = {
    "sync": {"optim": {"mode": "sync", "optimizer": "adamw"}},
    "async": {"optim": {"mode": "async", "optimizer": "adamw"}},
    "async-nag": {"optim": {"mode": "async", "optimizer": "nag"}},
}

# experiments/asynchrony.py: 4 stages x 2 servers (one layer each, as the paper cuts its 8 layers over
# 8 stages), 2 trainers, on one 2-core machine; every run of it adds a training mode and its settings.
ASYNC_EXPERIMENT: dict[str, Any] = {
    "model": {"d_model": 128, "n_heads": 4, "d_ff": 512, "n_layers": 4, "seq_len": 128, "num_stages": 4},
    "optim": {"lr": 1e-3, "nag_lr": 3e-5, "warmup_steps": 10, "target_batch_size": 32},
    "trainer": {"microbatch_size": 4, "max_inflight": 4, "min_request_timeout": 10.0},
    "rebalance": {"enabled": False},  # two servers per stage throughout, delayed ones included
    "local": {"servers_per_stage": 2, "trainers": 2, "threads_per_peer": 1, "timeout": 900.0},
}
