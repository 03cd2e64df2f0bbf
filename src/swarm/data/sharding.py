"""Fixed-length samples of the corpus, the samples held out for validation, and the order in which each
pass over the rest goes (trainers share a pass's blocks through the DHT: swarm.core.dataplan)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from swarm.config.schema import ConfigError
from swarm.wire.validate import IGNORE_INDEX

MIN_REAL_TOKENS = 8  # a document's tail shorter than this would be a sample made mostly of padding


def _chunk_document(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows of seq_len+1 tokens with a stride of seq_len: consecutive rows overlap by one token, so
    every next-token prediction in the document appears in exactly one sample. A short last row is
    padded with IGNORE_INDEX: its targets are skipped by the loss, and its inputs get the pad id
    (`split_inputs_targets`), so a pad id equal to a real token (a tokenizer's eos) is never mistaken
    for padding."""
    width = seq_len + 1
    min_real = min(MIN_REAL_TOKENS, width)
    if len(tokens) < min_real:
        return np.empty((0, width), dtype=np.int32)
    rows = -(-(len(tokens) - 1) // seq_len)
    padded = np.full(rows * seq_len + 1, IGNORE_INDEX, dtype=np.int32)
    padded[: len(tokens)] = tokens
    chunks = np.lib.stride_tricks.sliding_window_view(padded, width)[::seq_len]
    if len(tokens) - (rows - 1) * seq_len < min_real:
        chunks = chunks[:-1]
    return chunks


def chunk_stream(documents: Iterable[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Each document's samples as an int32 [n, seq_len+1] array (n may be 0)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    for tokens in documents:
        yield _chunk_document(tokens, seq_len)


def chunk_documents(documents: Iterable[np.ndarray], seq_len: int) -> np.ndarray:
    """All samples of the token documents as one int32 [N, seq_len+1] table; a row's position is its id."""
    parts = list(chunk_stream(documents, seq_len))
    return np.concatenate(parts) if parts else np.empty((0, seq_len + 1), dtype=np.int32)


class SampleTable:
    """Every sample of the corpus, the ones held out for validation, and the seeded order each pass over
    the others follows: every trainer computes the same table, split and orders, so a position in a pass
    names one sample everywhere, and no trainer ever trains on a held-out one.

    `chunks` is int32 [N, seq_len+1] (it may be a memory map of the token cache), IGNORE_INDEX where
    padded; `digest` is a digest of its content (swarm.data.cache.content_digest)."""

    def __init__(self, chunks: np.ndarray, pad_id: int, seed: int, digest: str, validation: int = 0) -> None:
        if len(chunks) == 0:
            raise ConfigError(f"data.path: the corpus gives no sample of {chunks.shape[1]} tokens")
        if validation >= len(chunks):
            raise ConfigError(f"data.validation_samples: {validation} leaves nothing to train on: the corpus "
                              f"gives {len(chunks)} samples")
        self._chunks = chunks
        self.pad_id = pad_id
        self._seed = seed
        self.digest = digest
        held = np.random.default_rng([seed, 2]).permutation(len(chunks))
        self._validation = np.sort(held[:validation])
        self._training = np.sort(held[validation:])
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Samples trained on (the held-out ones left out)."""
        return len(self._training)

    @property
    def name(self) -> str:
        """What identifies the orders: trainers that agree on it agree on every position's sample. The
        content digest keeps trainers with other text or another tokenizer from agreeing by accident."""
        return f"n{len(self)}v{len(self._validation)}s{self._seed}p{self.pad_id}-{self.digest[:12]}"

    def order(self, pass_: int) -> np.ndarray:
        """Sample ids in the order of pass `pass_` (the two latest passes are kept)."""
        if pass_ not in self._orders:
            shuffle = np.random.default_rng([self._seed, 1, pass_]).permutation(len(self))
            self._orders[pass_] = self._training[shuffle]
            for old in sorted(self._orders)[:-2]:
                del self._orders[old]
        return self._orders[pass_]

    def _rows(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self._chunks[ids], dtype=np.int64))

    def samples(self, pass_: int, start: int, end: int) -> torch.Tensor:
        """LongTensor[end - start, seq_len + 1]: positions [start, end) of pass `pass_`."""
        return self._rows(self.order(pass_)[start:end])

    def validation(self) -> torch.Tensor:
        """LongTensor[validation, seq_len + 1]: the held-out samples, in a fixed order."""
        return self._rows(self._validation)

    def stream(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Endless batches of `batch_size`, pass after pass, for a lone process (a benchmark); a pass's
        last samples that do not fill a batch are skipped."""
        if not 0 < batch_size <= len(self):
            raise ValueError(f"batch_size must be in (0, {len(self)}], got {batch_size}")
        for pass_ in itertools.count():
            for start in range(0, len(self) - batch_size + 1, batch_size):
                yield self.samples(pass_, start, start + batch_size)


def split_inputs_targets(batch: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] samples into next-token inputs [B, T] (padding as `pad_id`, an id the model embeds) and
    targets [B, T] (padding as IGNORE_INDEX, which the loss skips)."""
    inputs = batch[:, :-1].clone()
    inputs[inputs == IGNORE_INDEX] = pad_id
    return inputs, batch[:, 1:].contiguous()
