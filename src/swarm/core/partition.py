"""How a model's layers are cut into pipeline stages."""

from __future__ import annotations


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one.

    Earlier stages take the extra layers: the last stage also computes the output projection and the
    loss, so this keeps per-stage compute closest to even.
    """
    if num_stages <= 0 or num_stages > n_layers:
        raise ValueError(f"need 0 < num_stages <= n_layers, got {num_stages} stages for {n_layers} layers")
    size, extra = divmod(n_layers, num_stages)
    ranges: list[range] = []
    start = 0
    for stage in range(num_stages):
        stop = start + size + (1 if stage < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges
