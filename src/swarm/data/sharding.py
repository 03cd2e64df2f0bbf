"""Fixed-length samples, split into disjoint shards, one per trainer.

Every trainer computes the same chunk table and the same seeded permutation from the same corpus, so
shards are disjoint without any coordination between trainers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from swarm.config.schema import ConfigError
from swarm.model.gpt import PAD_ID

MIN_REAL_TOKENS = 8  # a document's tail shorter than this would be a sample made mostly of padding


def _chunk_document(document: bytes, seq_len: int) -> np.ndarray:
    """Rows of seq_len+1 tokens with a stride of seq_len: consecutive rows overlap by one token, so
    every next-byte prediction in the document appears in exactly one sample."""
    width = seq_len + 1
    min_real = min(MIN_REAL_TOKENS, width)
    tokens = np.frombuffer(document, dtype=np.uint8).astype(np.int16)
    if len(tokens) < min_real:
        return np.empty((0, width), dtype=np.int16)
    rows = -(-(len(tokens) - 1) // seq_len)
    padded = np.full(rows * seq_len + 1, PAD_ID, dtype=np.int16)
    padded[: len(tokens)] = tokens
    chunks = np.lib.stride_tricks.sliding_window_view(padded, width)[::seq_len]
    if len(tokens) - (rows - 1) * seq_len < min_real:
        chunks = chunks[:-1]
    return chunks


def chunk_documents(documents: Sequence[bytes], seq_len: int) -> np.ndarray:
    """All samples of the corpus as an int16 [N, seq_len+1] table (int16 holds PAD_ID at a quarter of
    int64's memory); a row's position is its chunk id."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    parts = [_chunk_document(document, seq_len) for document in documents]
    return np.concatenate(parts) if parts else np.empty((0, seq_len + 1), dtype=np.int16)


class SampleShard:
    """One trainer's share of the samples, served as an endless stream of shuffled batches."""

    def __init__(
        self, documents: Sequence[bytes], seq_len: int, shard_index: int, num_shards: int, seed: int
    ) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        table = chunk_documents(documents, seq_len)
        order = np.random.default_rng([seed, 0]).permutation(len(table))
        self._ids = np.sort(order[shard_index::num_shards])
        if len(self._ids) == 0:
            raise ConfigError(
                f"data.path: the corpus gives {len(table)} samples of {seq_len + 1} bytes, "
                f"too few for shard {shard_index} of {num_shards}"
            )
        self._chunks = torch.from_numpy(table[self._ids])
        self._seed = seed

    def __len__(self) -> int:
        return len(self._ids)

    def chunk_ids(self) -> list[int]:
        return self._ids.tolist()

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Endless LongTensor[batch_size, seq_len+1] batches. Each pass over the shard is reshuffled
        from (seed, pass) so a restarted trainer replays the same stream, and a batch may span two
        passes so no sample is ever dropped."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        pending = torch.empty(0, dtype=torch.long)
        epoch = 0
        while True:
            while len(pending) < batch_size:
                order = np.random.default_rng([self._seed, 1, epoch]).permutation(len(self))
                pending = torch.cat([pending, torch.from_numpy(order)])
                epoch += 1
            yield self._chunks[pending[:batch_size]].long()
            pending = pending[batch_size:]


def split_inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] samples into next-token inputs [B, T] and targets [B, T]."""
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
