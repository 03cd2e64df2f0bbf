"""A stage's state on disk: written atomically every few steps, the newest few kept, read on start.

A checkpoint holds what a replica would send a newcomer (parameters, buffers, optimizer state and
the epoch), so resuming from disk and joining from a peer are the same operation. Files are written
to a temporary name and renamed into place, so a crash mid-write never leaves a torn checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_NAME = re.compile(r"stage(\d+)-epoch(\d+)\.pt$")


class CheckpointStore:
    def __init__(self, directory: str | Path, stage: int, keep: int):
        self.dir = Path(directory)
        self.stage = stage
        self.keep = keep

    def _files(self) -> list[tuple[int, Path]]:
        """This stage's checkpoints, oldest first."""
        found = []
        for path in self.dir.glob(f"stage{self.stage}-epoch*.pt"):
            match = _NAME.search(path.name)
            if match and int(match.group(1)) == self.stage:
                found.append((int(match.group(2)), path))
        return sorted(found)

    def save(self, meta: dict, tensors: list[torch.Tensor]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"stage{self.stage}-epoch{int(meta['epoch']):08d}.pt"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"meta": meta, "tensors": tensors}, tmp)
        os.replace(tmp, path)
        for _, old in self._files()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> tuple[dict, list[torch.Tensor]] | None:
        """The newest readable checkpoint of this stage; unreadable files are skipped with a warning."""
        for _, path in reversed(self._files()):
            try:
                blob = torch.load(path, weights_only=True)
                return blob["meta"], blob["tensors"]
            except Exception as e:  # a truncated or foreign file: fall back to the one before
                log.warning("skipping unreadable checkpoint %s: %s", path, e)
        return None
