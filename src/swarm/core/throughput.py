"""Smoothed measurements that routing and timeouts are based on."""

from __future__ import annotations


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")


class RateMeter:
    """EWMA estimate of samples per second.

    Samples and busy seconds are smoothed separately and divided, rather than smoothing per-call
    rates: a tiny observation (one sample in a millisecond) then weighs as little as it lasted instead
    of swinging the estimate, and an observation of zero seconds is harmless.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        _check_alpha(alpha)
        self.alpha = alpha
        self._samples = 0.0
        self._seconds = 0.0
        self._observed = False

    def update(self, samples: int, seconds: float) -> None:
        if samples < 0 or seconds < 0:
            raise ValueError(f"samples and seconds must be >= 0, got {samples}, {seconds}")
        if not self._observed:
            # The first observation is taken as is, so the estimate is not biased towards zero.
            self._samples, self._seconds, self._observed = float(samples), seconds, True
            return
        self._samples += self.alpha * (samples - self._samples)
        self._seconds += self.alpha * (seconds - self._seconds)

    @property
    def rate(self) -> float:
        """Samples per second; 0.0 until some busy time has been observed."""
        return self._samples / self._seconds if self._seconds > 0 else 0.0


class StageRate:
    """Samples per second of a stage's whole work per sample (its forward and its backward pass), from
    one `RateMeter` per pass.

    Each pass's time is set against that pass's own samples. Counting samples once (when their
    backward is done) against all compute time would read near zero while a pipeline fills (forwards
    with no backward yet) and take long to recover. `passes` names the passes a sample goes through
    here: ("forward", "backward"), or one pass for a stage that does both in one call. Until every
    pass has been measured, the rate is 0 (unmeasured). `skip` first windows of each pass are left out:
    they carry one-off costs (first-call allocations, lazy initialization).
    """

    def __init__(self, passes: tuple[str, ...], alpha: float, skip: int = 0) -> None:
        if not passes:
            raise ValueError("a stage has at least one pass")
        self.passes = passes
        self.skip = skip
        self._meters = {p: RateMeter(alpha) for p in passes}
        self._seen = dict.fromkeys(passes, 0)

    def update(self, window: dict[str, tuple[int, float]]) -> None:
        """Fold in one window: pass -> (samples, seconds) of work done in it."""
        for name, (samples, seconds) in window.items():
            if name not in self._meters:
                raise ValueError(f"unknown pass {name!r}; this stage has {self.passes}")
            if seconds <= 0:
                continue
            self._seen[name] += 1
            if self._seen[name] > self.skip:
                self._meters[name].update(samples, seconds)

    @property
    def rate(self) -> float:
        rates = [m.rate for m in self._meters.values()]
        if any(r <= 0 for r in rates):
            return 0.0
        return 1.0 / sum(1.0 / r for r in rates)


class LatencyTracker:
    """Adaptive call timeout in the manner of TCP's retransmission timer (RFC 6298).

    Timing out at mean + 4 deviations lets a steady server be abandoned quickly when it stalls while
    a jittery one is not abandoned for ordinary variation.
    """

    def __init__(self, alpha: float = 0.125, beta: float = 0.25) -> None:
        _check_alpha(alpha)
        _check_alpha(beta)
        self.alpha = alpha
        self.beta = beta
        self._mean: float | None = None
        self._deviation = 0.0

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"latency must be >= 0, got {seconds}")
        if self._mean is None:
            self._mean, self._deviation = seconds, seconds / 2
            return
        self._deviation += self.beta * (abs(self._mean - seconds) - self._deviation)
        self._mean += self.alpha * (seconds - self._mean)

    @property
    def observed(self) -> bool:
        return self._mean is not None

    def timeout(self, floor: float, ceiling: float) -> float:
        """Seconds to wait for the next call; `ceiling` until anything was observed."""
        if floor > ceiling:
            raise ValueError(f"floor {floor} exceeds ceiling {ceiling}")
        if self._mean is None:
            return ceiling
        return min(max(self._mean + 4 * self._deviation, floor), ceiling)
