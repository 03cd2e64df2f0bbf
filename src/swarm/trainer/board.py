"""A trainer's figures in TensorBoard (`trainer.tensorboard_dir`): what it announces in the DHT, so that
TensorBoard, `swarm monitor` and /metrics show the same numbers."""

from __future__ import annotations

import math
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from swarm.config import ConfigError
from swarm.wire.records import TrainerRecord


class TrainerBoard:
    """Scalars of every float field of the trainer's record (its loss, samples/s, and a validation loss
    when the record has one), at a step counted in samples completed. Off without a directory."""

    def __init__(self, directory: str, index: int):
        """Refuses at once (before the trainer joins) where a directory is set but TensorBoard is missing."""
        self.path = Path(directory) / f"trainer-{index}" if directory else None
        self._writer: Any = None
        self._step = 0
        if self.path is not None:
            try:
                import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
            except ImportError:
                raise ConfigError("trainer.tensorboard_dir: logging to TensorBoard needs the tensorboard package "
                                  "(pip install 'swarm-parallel[monitor]'), or leave it empty") from None

    def add(self, record: TrainerRecord) -> None:
        """Log `record` once its trainer has completed samples since the last one logged (it is announced
        every second, whether or not anything moved)."""
        if self.path is None or record.completed <= self._step:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.path))
        now = time.time()
        for f in fields(record):
            value = getattr(record, f.name)
            if f.type == "float" and math.isfinite(value):
                self._writer.add_scalar(f.name, value, record.completed, walltime=now)
        self._writer.flush()  # readable while the run goes on: a scalar a second is little to write
        self._step = record.completed

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
