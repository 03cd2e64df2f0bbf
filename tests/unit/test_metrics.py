"""What a peer's /metrics and TensorBoard logs hold, read back as Prometheus and TensorBoard read them; and
the errors given where the `monitor` extra is missing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarm.config import ConfigError, NetConfig, load_config
from swarm.metrics import MetricsEndpoint, families, loss_scale_figures, peer_figures
from swarm.net.protocol import Traffic
from swarm.server.lossscale import LossScale
from swarm.trainer.board import TrainerBoard
from swarm.wire.records import ServerRecord, TrainerRecord


class Static:
    def __init__(self, figures):
        self.figures = figures

    def collect(self):
        return families(self.figures)


def exposed(figures) -> dict[str, float]:
    """The figures as a scrape shows them: sample name with its labels -> value."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Static(figures))
    text = generate_latest(registry).decode()
    return {s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_server_exports_its_record_its_counters_and_its_bytes() -> None:
    record = ServerRecord(peer_id="12D3KooWaaaaaa", stage=1, throughput=52.5, queue=3, epoch=7, pending=12,
                          config_hash="h", model={}, capacity=50.0, tenure=31.0, moving=True, previous_stage=0)
    traffic = Traffic()
    traffic.add("activations", "sent", 100)
    traffic.add("activations", "received", 40)
    traffic.add("allreduce", "sent", 8)
    counters = {"refused": 3, "failed_rounds": 1, "samples_served": 640}
    m = exposed(peer_figures("server", record, counters, traffic))
    assert (m["swarm_server_stage"], m["swarm_server_previous_stage"], m["swarm_server_epoch"]) == (1, 0, 7)
    assert (m["swarm_server_queue"], m["swarm_server_pending_samples"], m["swarm_server_moving"]) == (3, 12, 1)
    assert m["swarm_server_throughput_samples_per_second"] == 52.5 and m["swarm_server_tenure_seconds"] == 31.0
    assert m["swarm_server_refused_total"] == 3 and m["swarm_server_failed_rounds_total"] == 1
    assert m["swarm_server_samples_served_total"] == 640
    assert m["swarm_wire_bytes_total[direction=sent][role=activations]"] == 100
    assert m["swarm_wire_bytes_total[direction=received][role=activations]"] == 40
    assert m["swarm_wire_bytes_total[direction=received][role=allreduce]"] == 0
    assert not any(name.startswith("swarm_trainer") for name in m)


def test_a_server_in_fp16_exports_its_loss_scale_and_its_overflows() -> None:
    assert exposed(loss_scale_figures(LossScale(2.0**12, overflows=3))) == {
        "swarm_server_fp16_loss_scale": 4096.0, "swarm_server_fp16_overflows_total": 3.0}
    assert loss_scale_figures(None) == []


def test_a_trainer_exports_samples_as_a_counter_and_no_loss_before_it_has_one() -> None:
    record = TrainerRecord(peer_id="12D3KooWtttttt", completed=640, failed=2, loss=math.nan, done=False,
                           samples_per_second=21.5)
    m = exposed(peer_figures("trainer", record, {"retries": 4, "replays": 1}, Traffic()))
    assert m["swarm_trainer_samples_total"] == 640 and m["swarm_trainer_failed_microbatches_total"] == 2
    assert m["swarm_trainer_samples_per_second"] == 21.5 and m["swarm_trainer_done"] == 0
    assert m["swarm_trainer_retries_total"] == 4 and m["swarm_trainer_replays_total"] == 1
    assert "swarm_trainer_loss" not in m
    assert exposed(peer_figures("trainer", None, {"retries": 0}, Traffic())) == {"swarm_trainer_retries_total": 0}


def test_a_metrics_port_without_prometheus_client_is_refused_at_start(monkeypatch) -> None:
    MetricsEndpoint(NetConfig(), "server").start("12D3KooWaaaaaa", "", list)  # port 0: off, nothing served
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as where the `monitor` extra is not installed
    with pytest.raises(ConfigError, match=r"net.metrics_port: .*pip install 'swarm-parallel\[monitor\]'"):
        MetricsEndpoint(NetConfig(metrics_port=9400), "server")
    with pytest.raises(ConfigError, match="net.metrics_port: must be a port number"):
        load_config(overrides=["net.metrics_port=70000"])


def test_tensorboard_holds_the_trainer_figures_at_its_sample_count(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TrainerBoard(str(tmp_path), index=3)
    for completed, loss in ((0, math.nan), (64, 3.5), (64, 3.5), (128, math.nan), (192, 2.75)):
        board.add(TrainerRecord("12D3KooWtttttt", completed, 0, loss, False, completed / 10))
    board.close()
    events = EventAccumulator(str(tmp_path / "trainer-3"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "samples_per_second"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(64, 3.5), (192, 2.75)]  # stored as float32
    speeds = events.Scalars("samples_per_second")
    assert [e.step for e in speeds] == [64, 128, 192]
    assert [e.value for e in speeds] == pytest.approx([6.4, 12.8, 19.2])
    assert TrainerBoard("", index=0).path is None  # off: nothing written


def test_a_tensorboard_dir_without_tensorboard_is_refused_at_start(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"trainer.tensorboard_dir: .*pip install 'swarm-parallel\[monitor\]'"):
        TrainerBoard(str(tmp_path), index=0)
