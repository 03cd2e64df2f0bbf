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
