"""Text from columnar files: Parquet, Arrow, and datasets saved with `datasets`' `save_to_disk`.

They are read a batch of rows at a time through pyarrow (which `datasets` brings along), memory-mapped
where the format allows, so reading stops as soon as the corpus has enough text and a large dataset is
never loaded whole. Nothing is written next to them or into a Hugging Face cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swarm.config.schema import ConfigError

COLUMN_SUFFIXES = {".parquet", ".arrow"}
ROWS_PER_BATCH = 1024


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (loads the submodule)
    except ImportError as exc:
        raise ConfigError("data.path: reading .parquet, .arrow and saved datasets needs pyarrow "
                          "(pip install 'swarm-parallel[hf]')") from exc
    return pyarrow


def is_saved_dataset(path: Path) -> bool:
    """A directory `save_to_disk` wrote: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _require_column(where: Path, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise ConfigError(f'data.text_field: {where} has no column "{field}" (columns: {", ".join(columns)})')


def _texts(batches: Iterator[Any], field: str, where: Path) -> Iterator[bytes]:
    """The non-null strings of column `field` of record batches, as UTF-8."""
    pa = _pyarrow()
    for batch in batches:
        column = batch.column(field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ConfigError(f'data.text_field: column "{field}" of {where} holds {column.type}, not text')
        for text in column.to_pylist():
            if text:
                yield text.encode("utf-8")


def column_documents(path: Path, field: str) -> Iterator[bytes]:
    """Each row's text of a .parquet file, or of an .arrow file (Arrow's file format, or the stream format
    `datasets` writes)."""
    pa = _pyarrow()
    try:
        if path.suffix == ".parquet":
            parquet = pa.parquet.ParquetFile(path)
            _require_column(path, field, parquet.schema_arrow.names)
            yield from _texts(parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[field]), field, path)
            return
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            _require_column(path, field, reader.schema.names)
            yield from _texts(batches, field, path)
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"data.path: cannot read {path}: {type(exc).__name__}: {exc}") from exc


def dataset_documents(path: Path, field: str, split: str) -> Iterator[bytes]:
    """Each row's text of a dataset saved with `save_to_disk` (of split `split` for a DatasetDict), read
    through `datasets.load_from_disk`, which memory-maps its Arrow files and applies its row order."""
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("data.path: a dataset saved with save_to_disk needs datasets "
                          "(pip install 'swarm-parallel[hf]')") from exc
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ConfigError(f"data.split: {path} has splits {', '.join(splits)}, not {split!r}")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded[split]
    _require_column(path, field, loaded.column_names)
    yield from _texts(loaded.select_columns([field]).with_format("arrow").iter(batch_size=ROWS_PER_BATCH),
                      field, path)
