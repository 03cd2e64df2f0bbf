"""Delays between retries."""

from __future__ import annotations

import random

# 2.0 ** 1000 is still a finite float; beyond it the cap applies anyway.
_MAX_EXPONENT = 1000


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Capped exponential backoff with full jitter: uniform in [0, min(cap, base * 2**attempt)].

    Full jitter rather than a fixed schedule so that callers that failed together (one server went
    down under many trainers) do not all come back at the same instant.
    """
    if attempt < 0 or base < 0 or cap < 0:
        raise ValueError(f"attempt, base and cap must be >= 0, got {attempt}, {base}, {cap}")
    ceiling = min(cap, base * 2.0 ** min(attempt, _MAX_EXPONENT))
    return rng.uniform(0.0, ceiling)
