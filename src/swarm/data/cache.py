"""Tokenized samples kept on disk, so a corpus is tokenized once per machine and not at every start.

An entry is named by a digest of everything that decides its content: the text itself (every document's
bytes, in order), the tokenizer's identity, `model.seq_len` and the layout's `FORMAT`. Change any of them
and the digest changes, so an entry is never stale, only unused. An entry is a raw int32 file of
[rows, seq_len+1] samples, memory-mapped when read (trainers on one machine share its pages), and a JSON
file written after it, atomically, that marks it complete and holds the digest of the samples themselves
(`content_digest`, which names the table: swarm.data.sharding).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from swarm.config.schema import ConfigError

FORMAT = 1  # bumped whenever the chunking or the file layout changes


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "swarm" / "tokens"


def content_digest(parts: Iterable[np.ndarray]) -> str:
    """A digest of int32 samples, the same however they are split into parts."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(np.ascontiguousarray(part, dtype=np.int32).tobytes())
    return digest.hexdigest()


def cache_key(text_digest: str, tokens_identity: str, seq_len: int) -> str:
    blob = json.dumps({"format": FORMAT, "text": text_digest, "tokens": tokens_identity, "seq_len": seq_len})
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


class TokenCache:
    def __init__(self, root: Path, key: str, width: int):
        self.root, self.key, self.width = root, key, width
        self.path = root / f"{key}.tokens"
        self._meta = root / f"{key}.json"

    def load(self) -> tuple[np.ndarray, str] | None:
        """The entry's samples, memory-mapped read-only, and their content digest; None if there is no
        complete entry."""
        try:
            meta = json.loads(self._meta.read_text())
            rows, digest = int(meta["rows"]), str(meta["digest"])
            if self.path.stat().st_size != rows * self.width * 4:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if rows == 0:
            return np.empty((0, self.width), dtype=np.int32), digest
        return np.memmap(self.path, dtype=np.int32, mode="r", shape=(rows, self.width)), digest

    def store(self, parts: Iterable[np.ndarray], about: dict) -> tuple[np.ndarray, str]:
        """Write the samples as they come (the table is never whole in memory), then mark the entry
        complete; trainers that write the same entry at once each write their own file, and the last
        rename wins (the contents are equal)."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        digest, rows = hashlib.blake2b(digest_size=16), 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as out:
                for part in parts:
                    data = np.ascontiguousarray(part, dtype=np.int32).tobytes()
                    out.write(data)
                    digest.update(data)
                    rows += len(part)
            os.replace(tmp, self.path)
            meta_tmp = self._meta.with_name(f"{self._meta.name}.{os.getpid()}.tmp")
            meta_tmp.write_text(json.dumps({**about, "rows": rows, "width": self.width, "format": FORMAT,
                                            "digest": digest.hexdigest()}))
            os.replace(meta_tmp, self._meta)
        except OSError as exc:
            raise ConfigError(f"data.cache_dir: cannot write the token cache in {self.root}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        loaded = self.load()
        if loaded is None:
            raise ConfigError(f"data.cache_dir: the token cache entry {self.path} did not read back once written")
        return loaded
