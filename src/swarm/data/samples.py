"""The sample table a trainer works from: text read (swarm.data.corpus), turned into ids
(swarm.data.tokens), cut into samples (swarm.data.sharding) and, when a tokenizer is used, cached
(swarm.data.cache). Every trainer with the same text, tokenizer and settings builds the same table."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from swarm.config.schema import DataConfig, ModelConfig
from swarm.data.cache import TokenCache, cache_key, content_digest, default_root
from swarm.data.corpus import documents, load_documents
from swarm.data.sharding import SampleTable, chunk_documents, chunk_stream
from swarm.data.tokens import BYTES, Tokens, check_vocab, load_tokens

log = logging.getLogger("swarm.data")
BATCH_BYTES = 4 << 20  # text handed to the tokenizer at once: large enough for its threads, small in memory


def text_digest(texts: Iterable[bytes]) -> tuple[str, int, int]:
    """A digest of the documents (their bytes and where each ends), their count, and their total size."""
    digest = hashlib.blake2b(digest_size=16)
    count = size = 0
    for text in texts:
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text)
        count, size = count + 1, size + len(text)
    return digest.hexdigest(), count, size


def _batches(texts: Iterable[bytes]) -> Iterator[list[bytes]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _ids(tokens: Tokens, texts: Iterable[bytes]) -> Iterator[np.ndarray]:
    """Each document's ids, encoded a batch at a time."""
    return (one for batch in _batches(texts) for one in tokens.encode(batch))


def _tokenized(data: DataConfig, tokens: Tokens, seq_len: int) -> tuple[np.ndarray, str]:
    """The tokenized corpus from the cache, or tokenized now and cached, and its content digest. The text
    is read twice on a miss (once for its digest, once to tokenize) so that it is never held whole in
    memory."""
    digest, count, size = text_digest(documents(data))
    key = cache_key(digest, tokens.identity, seq_len)
    cache = TokenCache(Path(data.cache_dir) if data.cache_dir else default_root(), key, seq_len + 1)
    cached = cache.load()
    if cached is not None:
        chunks, content = cached
        log.info("read %d samples of %d tokens from the token cache %s (%s, %d documents unchanged since "
                 "they were tokenized)", len(chunks), seq_len + 1, cache.path, tokens.name, count)
        return chunks, content
    started = time.monotonic()
    about = {"path": data.path, "text_field": data.text_field, "tokenizer": data.tokenizer, "documents": count}
    chunks, content = cache.store(chunk_stream(_ids(tokens, documents(data)), seq_len), about)
    log.info("tokenized %d documents (%.1f MB of text) with %s into %d samples of %d tokens in %.1fs; cached "
             "in %s", count, size / 1e6, tokens.name, len(chunks), seq_len + 1, time.monotonic() - started,
             cache.path)
    return chunks, content


def load_samples(data: DataConfig, model: ModelConfig) -> SampleTable:
    """The samples of `data` for `model` (ConfigError if the model's vocabulary is too small for them).
    The table is named by the digest of the samples themselves, so trainers agree exactly when their
    samples are equal, whatever library versions made them."""
    tokens = load_tokens(data)
    check_vocab(tokens, model)
    if tokens is BYTES:  # bytes need no tokenizing, so nothing is cached: cut them directly
        chunks = chunk_documents(_ids(BYTES, load_documents(data)), model.seq_len)
        content = content_digest([chunks])
    else:
        chunks, content = _tokenized(data, tokens, model.seq_len)
    return SampleTable(chunks, tokens.pad_id, data.seed, content, data.validation_samples)
