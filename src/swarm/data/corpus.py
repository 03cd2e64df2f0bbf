"""Training text as a stream of documents (UTF-8 bytes), read in a fixed order.

The default corpus is the Python standard library's own source: real, varied text that every
machine with Python already has, so a demo swarm trains on something meaningful with no download.
Documents are kept separate so samples never straddle two unrelated files or records.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from swarm.config.schema import ConfigError, DataConfig
from swarm.data.columns import COLUMN_SUFFIXES, column_documents, dataset_documents, is_saved_dataset

_FILE_SUFFIXES = {".txt", ".md", ".jsonl", ".py", *COLUMN_SUFFIXES}
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


def _jsonl_documents(path: Path, field: str) -> Iterator[bytes]:
    try:
        with path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"data.path: {path}:{number} is not valid JSON: {exc}") from exc
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise ConfigError(f'data.path: {path}:{number} lacks a string field "{field}" (data.text_field)')
                yield record[field].encode("utf-8")
    except OSError as exc:
        raise ConfigError(f"data.path: cannot read {path}: {exc}") from exc


def _file_documents(path: Path, cfg: DataConfig, limit: int) -> Iterator[bytes]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, cfg.text_field)
    elif path.suffix in COLUMN_SUFFIXES:
        yield from column_documents(path, cfg.text_field)
    else:
        yield _read(path, limit)


def _path_documents(path: Path, cfg: DataConfig) -> Iterator[bytes]:
    if path.is_file():
        yield from _file_documents(path, cfg, cfg.max_bytes)
    elif is_saved_dataset(path):
        yield from dataset_documents(path, cfg.text_field, cfg.split)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _FILE_SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(f"data.path: directory {path} has no {', '.join(sorted(_FILE_SUFFIXES))} files, "
                              "nor is it a dataset saved with save_to_disk")
        for file in files:
            yield from _file_documents(file, cfg, cfg.max_bytes)
    else:
        raise ConfigError(f"data.path: {path} does not exist")


def documents(cfg: DataConfig) -> Iterator[bytes]:
    """Documents in a fixed order, at most `cfg.max_bytes` in total. Reading stops as soon as the cap is
    met, so a huge corpus costs no more than the part that is used; a second call reads them again."""
    if cfg.path is None:
        source: Iterator[bytes] = (_read(path, cfg.max_bytes) for path in _stdlib_files())
    else:
        source = _path_documents(Path(cfg.path), cfg)
    budget, found = cfg.max_bytes, False
    for document in source:
        if document:
            found = True
            yield document[:budget]
            budget -= len(document[:budget])
        if budget == 0:
            break
    if not found:
        where = cfg.path if cfg.path is not None else sysconfig.get_paths()["stdlib"]
        raise ConfigError(f"data.path: no text found in {where}")


def load_documents(cfg: DataConfig) -> list[bytes]:
    """All of `documents`, in memory."""
    return list(documents(cfg))
