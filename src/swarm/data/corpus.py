"""Training text as a list of byte documents.

The default corpus is the Python standard library's own source: real, varied text that every
machine with Python already has, so a demo swarm trains on something meaningful with no download.
Documents are kept separate so samples never straddle two unrelated files.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from swarm.config.schema import ConfigError, DataConfig

_TEXT_SUFFIXES = {".txt", ".md", ".jsonl", ".py"}
# Vendored packages and test suites are skipped: they differ between installs, and peers must read the
# same corpus to agree on their disjoint shards.
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _read(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(limit)
    except OSError as exc:
        raise ConfigError(f"data.path: cannot read {path}: {exc}") from exc


def _jsonl_documents(path: Path) -> Iterator[bytes]:
    try:
        with path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"data.path: {path}:{number} is not valid JSON: {exc}") from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ConfigError(f'data.path: {path}:{number} lacks a string field "text"')
                yield record["text"].encode("utf-8")
    except OSError as exc:
        raise ConfigError(f"data.path: cannot read {path}: {exc}") from exc


def _file_documents(path: Path, limit: int) -> Iterator[bytes]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path)
    else:
        yield _read(path, limit)


def _path_documents(path: Path, limit: int) -> Iterator[bytes]:
    if path.is_file():
        yield from _file_documents(path, limit)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(f"data.path: directory {path} has no {', '.join(sorted(_TEXT_SUFFIXES))} files")
        for file in files:
            yield from _file_documents(file, limit)
    else:
        raise ConfigError(f"data.path: {path} does not exist")


def load_documents(cfg: DataConfig) -> list[bytes]:
    """Documents in a fixed order, at most `cfg.max_bytes` in total. Reading stops as soon as the cap is
    met, so a huge corpus costs no more than the part that is used."""
    if cfg.path is None:
        source: Iterator[bytes] = (_read(path, cfg.max_bytes) for path in _stdlib_files())
    else:
        source = _path_documents(Path(cfg.path), cfg.max_bytes)
    documents: list[bytes] = []
    budget = cfg.max_bytes
    for document in source:
        if document:
            documents.append(document[:budget])
            budget -= len(documents[-1])
        if budget == 0:
            break
    if not documents:
        where = cfg.path if cfg.path is not None else sysconfig.get_paths()["stdlib"]
        raise ConfigError(f"data.path: no text found in {where}")
    return documents
