"""How text becomes token ids: bytes (the default, no tokenizer), or a Hugging Face tokenizer read from
a local directory (never the hub).

Each document is encoded without the tokenizer's own special tokens and ends with its eos token, if it
has one, so the model learns where documents end. Padding takes the tokenizer's pad id (its eos id when
it has none); padded targets are IGNORE_INDEX whatever the pad id is (swarm.data.sharding).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swarm.config.schema import ConfigError, DataConfig, ModelConfig

BYTE_PAD_ID = 256  # byte values use 0..255; padded inputs take the one extra id
BYTE_VOCAB = 257


@dataclass(frozen=True)
class Tokens:
    name: str  # what the ids come from, for messages
    pad_id: int
    vocab_size: int  # every id it produces (the pad id included) is below it
    identity: str  # digest of what decides the ids (a key of the token cache)
    encode: Callable[[list[bytes]], list[np.ndarray]]  # documents (UTF-8) -> int32 ids, one array each


def _byte_ids(documents: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(document, dtype=np.uint8).astype(np.int32) for document in documents]


BYTES = Tokens("bytes (no data.tokenizer)", BYTE_PAD_ID, BYTE_VOCAB, "bytes", _byte_ids)


def _digest(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=16).hexdigest()


def _load_hf(path: str) -> Any:
    if not Path(path).is_dir():
        raise ConfigError(f"data.tokenizer: {path} is not a directory. Tokenizers are read from local "
                          "directories only (write one with tokenizer.save_pretrained(DIR))")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError("data.tokenizer: needs transformers (pip install 'swarm-parallel[hf]')") from exc
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # any of the many ways a directory is not a tokenizer
        raise ConfigError(f"data.tokenizer: no tokenizer could be loaded from {path}: "
                          f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from exc


def _hf_tokens(path: str) -> Tokens:
    tokenizer = _load_hf(path)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if pad is None:
        raise ConfigError(f"data.tokenizer: the tokenizer in {path} has neither a pad nor an eos token; "
                          "padding needs one of them")
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
    # what decides the ids: the whole tokenizer as a fast one serializes itself, else its vocabulary
    rules = json.loads(tokenizer.backend_tokenizer.to_str()) if tokenizer.is_fast else sorted(vocab.items())
    identity = _digest({"class": type(tokenizer).__name__, "rules": rules, "pad": pad, "eos": eos})
    tail = [] if eos is None else [eos]

    def encode(documents: list[bytes]) -> list[np.ndarray]:
        texts = [document.decode("utf-8", errors="replace") for document in documents]
        # verbose=False: documents are longer than the model's window by design (they are cut into samples)
        ids = tokenizer(texts, add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(one + tail, dtype=np.int32) for one in ids]

    return Tokens(f"the tokenizer in {path}", pad, size, identity, encode)


def load_tokens(data: DataConfig) -> Tokens:
    return BYTES if data.tokenizer is None else _hf_tokens(data.tokenizer)


def check_vocab(tokens: Tokens, model: ModelConfig) -> None:
    """The model must have an embedding (and an output) for every id the data holds."""
    if model.vocab_size < tokens.vocab_size:
        raise ConfigError(f"model.vocab_size: {model.vocab_size} does not cover the {tokens.vocab_size} ids of "
                          f"{tokens.name}; set model.vocab_size to at least {tokens.vocab_size}")
