"""How a model's layers are cut into pipeline stages."""

from __future__ import annotations


def split_evenly(total: int, parts: int) -> list[range]:
    """Contiguous ranges covering `range(total)`, one per part, sizes differing by at most one (earlier
    parts take the extra elements)."""
    size, extra = divmod(total, parts)
    ranges: list[range] = []
    start = 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one.

    Earlier stages take the extra layers: the last stage also computes the output projection and the
    loss, so this keeps per-stage compute closest to even.
    """
    if num_stages <= 0 or num_stages > n_layers:
        raise ValueError(f"need 0 < num_stages <= n_layers, got {num_stages} stages for {n_layers} layers")
    return split_evenly(n_layers, num_stages)
