"""A swarm trains on a tokenized dataset saved to disk and reports a held-out validation loss: in the
trainer's log, its summary and its DHT record, without the evaluations touching any stage's gradients."""

from __future__ import annotations

import json
import math
import re

import pytest

from swarm.data import load_samples
from swarm.ops.local import LocalSwarm

from ..unit.test_hf_data import save_tokenizer, texts
from .helpers import assert_exactly_once, run_swarm, small_config

pytestmark = pytest.mark.integration
VALIDATION = re.compile(r"validation loss (\d+\.\d{4}) over 12 samples at step (\d+)")


@pytest.mark.timeout(240)
def test_a_swarm_on_a_tokenized_dataset_reports_its_validation_loss(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": texts(count=300)}).save_to_disk(tmp_path / "dataset")
    tokenizer = save_tokenizer(tmp_path / "tokenizer", pad=True)
    cfg = small_config(
        tmp_path / "run", f'data.path="{tmp_path / "dataset"}"', f'data.tokenizer="{tokenizer}"',
        f'data.cache_dir="{tmp_path / "cache"}"', "data.validation_samples=12", "trainer.eval_every=3",
        "model.vocab_size=300", "model.seq_len=32", "trainer.target_steps=6", "local.servers_per_stage=1",
        "local.trainers=1", "trainer.max_inflight=4",
    )
    load_samples(cfg.data, cfg.model)  # as a first start on this machine would: the trainer reads the cache
    announced: list[tuple[float, int]] = []

    def watch(status) -> None:
        announced.extend((t.val_loss, t.val_step) for t in status.trainers if not math.isnan(t.val_loss))

    summary = run_swarm(LocalSwarm(cfg), watch)

    (log,) = (tmp_path / "run" / "logs").glob("trainer-*.log")
    text = log.read_text()
    assert "I swarm.data: read 528 samples of 33 tokens from the token cache" in text
    assert "I swarm.data: tokenized" not in text
    logged = [(float(loss), int(step)) for loss, step in VALIDATION.findall(text)]
    assert logged[0][1] == 0 and logged[-1][1] >= cfg.trainer.target_steps  # a baseline, and where training ended
    assert [s for _, s in logged] == sorted({s for _, s in logged})
    assert logged[-1][0] < logged[0][0] - 0.5, logged  # the model learned, as held-out text shows
    (trainer,) = [json.loads(p.read_text()) for p in (tmp_path / "run" / "peers").glob("trainer-*.json")]
    assert [(round(v["loss"], 4), v["step"]) for v in trainer["validation"]] == logged
    assert all(v["samples"] == 12 and v["tokens"] > 12 * 16 for v in trainer["validation"])
    assert set(announced) <= {(v["loss"], v["step"]) for v in trainer["validation"]} and announced
    reported = [(v["step"], v["loss"]) for v in summary["validation"]]  # the run's summary.json
    assert reported == [(v["step"], v["loss"]) for v in trainer["validation"]]
    # evaluations are never accumulated: every stepped microbatch is a completed training one, once
    assert_exactly_once(summary)
