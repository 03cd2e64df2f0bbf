"""Fixed-length samples of the corpus, and the order in which each pass over them goes (trainers share
a pass's blocks through the DHT: swarm.core.dataplan)."""

from __future__ import annotations

import itertools
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


class SampleTable:
    """Every sample of the corpus, and the seeded order each pass over it follows: every trainer computes
    the same table and the same orders, so a position in a pass names one sample everywhere."""

    def __init__(self, documents: Sequence[bytes], seq_len: int, seed: int) -> None:
        table = chunk_documents(documents, seq_len)
        if len(table) == 0:
            raise ConfigError(f"data.path: the corpus gives no sample of {seq_len + 1} bytes")
        self._chunks = torch.from_numpy(table)
        self._seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def name(self) -> str:
        """What identifies the orders: trainers that agree on it agree on every position's sample."""
        return f"n{len(self)}s{self._seed}"

    def order(self, pass_: int) -> np.ndarray:
        """Chunk ids in the order of pass `pass_` (the two latest passes are kept)."""
        if pass_ not in self._orders:
            self._orders[pass_] = np.random.default_rng([self._seed, 1, pass_]).permutation(len(self))
            for old in sorted(self._orders)[:-2]:
                del self._orders[old]
        return self._orders[pass_]

    def samples(self, pass_: int, start: int, end: int) -> torch.Tensor:
        """LongTensor[end - start, seq_len + 1]: positions [start, end) of pass `pass_`."""
        return self._chunks[torch.from_numpy(self.order(pass_)[start:end])].long()

    def stream(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Endless batches of `batch_size`, pass after pass, for a lone process (a benchmark); a pass's
        last samples that do not fill a batch are skipped."""
        if not 0 < batch_size <= len(self):
            raise ValueError(f"batch_size must be in (0, {len(self)}], got {batch_size}")
        for pass_ in itertools.count():
            for start in range(0, len(self) - batch_size + 1, batch_size):
                yield self.samples(pass_, start, start + batch_size)


def split_inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] samples into next-token inputs [B, T] and targets [B, T]."""
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
