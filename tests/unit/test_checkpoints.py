"""Stage checkpoints: atomic files, bounded retention, newest readable one wins."""

from __future__ import annotations

import torch

from swarm.server.checkpoints import CheckpointStore


def _state(epoch: int) -> tuple[dict, list[torch.Tensor]]:
    return {"epoch": epoch, "names": ["w"], "opt_keys": []}, [torch.full((3,), float(epoch))]


def test_keeps_the_newest_and_loads_the_latest(tmp_path):
    store = CheckpointStore(tmp_path, stage=1, keep=2)
    for epoch in (2, 4, 6):
        store.save(*_state(epoch))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["stage1-epoch00000004.pt", "stage1-epoch00000006.pt"]  # no temporary files left
    meta, tensors = store.latest()
    assert meta["epoch"] == 6 and torch.equal(tensors[0], torch.full((3,), 6.0))


def test_other_stages_are_ignored_and_an_empty_directory_has_none(tmp_path):
    CheckpointStore(tmp_path, stage=0, keep=2).save(*_state(3))
    assert CheckpointStore(tmp_path, stage=1, keep=2).latest() is None
    assert CheckpointStore(tmp_path / "missing", stage=0, keep=2).latest() is None


def test_a_torn_newest_file_falls_back_to_the_one_before(tmp_path):
    store = CheckpointStore(tmp_path, stage=0, keep=3)
    store.save(*_state(5))
    (tmp_path / "stage0-epoch00000009.pt").write_bytes(b"not a checkpoint")
    meta, _ = store.latest()
    assert meta["epoch"] == 5
