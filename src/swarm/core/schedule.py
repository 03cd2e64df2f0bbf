"""Learning-rate schedule."""

from __future__ import annotations


def warmup_lr(step: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warm-up over `warmup_steps` optimizer steps, then constant.

    Step 0 already uses base_lr / warmup_steps rather than 0, so the first averaged step is not wasted.
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be >= 0, got {step}, {warmup_steps}")
    if step >= warmup_steps:
        return base_lr
    return base_lr * (step + 1) / warmup_steps
