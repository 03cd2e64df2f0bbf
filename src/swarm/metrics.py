"""Prometheus metrics of a server or a trainer, at http://net.host:net.metrics_port/metrics.

Nothing is counted twice: a scrape reads the figures the peer keeps anyway (what it announces in the DHT,
the counters its summary reports, the bytes its `Traffic` counted), at the moment of the scrape. The HTTP
server runs in a thread of its own, while those figures change on the peer's event loop, so a scrape
asks the loop to read them (a dict read while the loop adds to it would fail). A server's counters start
again from zero when it moves to another stage, as its summary's do: Prometheus takes that for a counter
reset, as when a process restarts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from swarm.config import ConfigError, NetConfig
from swarm.net.directory import short
from swarm.net.protocol import Traffic

log = logging.getLogger(__name__)
READ_TIMEOUT = 5.0  # seconds a scrape waits for the event loop to read the figures
INSTALL = "pip install 'swarm-parallel[monitor]'"

# a record's field -> (metric name, counter?, help); a numeric field not listed (one a newer version adds)
# is exported as a gauge under its own name
RECORD_METRICS: dict[str, tuple[str, bool, str]] = {
    "stage": ("stage", False, "the stage it serves"),
    "previous_stage": ("previous_stage", False, "the stage it moved here from (-1: it joined here)"),
    "throughput": ("throughput_samples_per_second", False,
                   "samples/s of forward+backward compute over the last seconds (what trainers route by)"),
    "capacity": ("capacity_samples_per_second", False, "the same over a longer window (what rebalancing counts)"),
    "queue": ("queue", False, "requests waiting for compute"),
    "calls": ("calls_in_hand", False, "calls received and not yet answered, whatever they wait on"),
    "epoch": ("epoch", False, "optimizer steps (averaging rounds in async mode) its stage has taken"),
    "pending": ("pending_samples", False, "samples accumulated toward the stage's next step"),
    "tenure": ("tenure_seconds", False, "seconds it has served this stage"),
    "moving": ("moving", False, "1 while it finishes its work here before it moves to another stage"),
    "fresh": ("fresh_start_time_seconds", False, "unix time its operator started the stage afresh (0: never)"),
    "protocol": ("protocol_version", False, "the wire protocol version it speaks"),
    "completed": ("samples", True, "samples whose backward reached stage 0"),
    "failed": ("failed_microbatches", True, "microbatches given up after all retries"),
    "loss": ("loss", False, "mean loss of its last 20 microbatches"),
    "samples_per_second": ("samples_per_second", False, "samples/s completed over the last trainer.progress_every s"),
    "done": ("done", False, "1 once it stopped sending work and drained what it had in flight"),
}
COUNTER_HELP = {
    "refused": "requests refused by its checks (malformed, oversized or out-of-bounds tensors, other settings)",
    "stale_refusals": "requests refused because this replica was behind its stage's epoch",
    "busy_refusals": "forwards turned away because the work queued ahead would outlast their callers' timeouts",
    "failed_rounds": "all-reduce rounds that failed and were retried",
    "catch_ups": "downloads of its stage's state to catch up with its replicas",
    "lost_samples": "unstepped samples it dropped (their trainers accumulate them again elsewhere)",
    "samples_served": "samples it took in for forward passes",
    "retries": "stage calls sent again, to the same server or another",
    "replays": "gradients accumulated again after the replica that held them was lost",
}


@dataclass(frozen=True)
class Figure:
    """One sample of one metric, before it is handed to prometheus_client."""

    name: str  # full metric name (a counter's without `_total`)
    counter: bool
    help: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def record_figures(role: str, record: Any) -> list[Figure]:
    """Every number of the DHT record the peer announced (`role` is server or trainer)."""
    out = []
    for f in fields(record):
        value = getattr(record, f.name)
        if f.name == "peer_id" or not isinstance(value, (int, float)):
            continue
        name, counter, text = RECORD_METRICS.get(f.name, (f.name, False, f"`{f.name}` of its DHT record"))
        if math.isfinite(value):  # a trainer with no loss yet has none to show
            out.append(Figure(f"swarm_{role}_{name}", counter, text, float(value)))
    return out


def counter_figures(role: str, counters: dict[str, float]) -> list[Figure]:
    """The counters its summary reports."""
    return [Figure(f"swarm_{role}_{name}", True, COUNTER_HELP.get(name, f"`{name}` of its summary"), float(n))
            for name, n in sorted(counters.items())]


def traffic_figures(traffic: Traffic) -> list[Figure]:
    return [Figure("swarm_wire_bytes", True, "bytes on the wire by tensor role and direction", float(n),
                   (("role", role), ("direction", direction)))
            for role, counts in traffic.as_dict().items() for direction, n in sorted(counts.items())]


def loss_scale_figures(scale: Any | None) -> list[Figure]:
    """A server computing in fp16 (`swarm.server.lossscale.LossScale`; None: it does not)."""
    if scale is None:
        return []
    return [Figure("swarm_server_fp16_loss_scale", False, "the loss scale its fp16 backwards run at",
                   float(scale.scale)),
            Figure("swarm_server_fp16_overflows", True, "backwards run again at half the loss scale after an overflow",
                   float(scale.overflows))]


def peer_figures(role: str, record: Any | None, counters: dict[str, float], traffic: Traffic) -> list[Figure]:
    """A peer's metrics: its last record (None before it first announced), its counters, its bytes."""
    announced = record_figures(role, record) if record is not None else []
    return announced + counter_figures(role, counters) + traffic_figures(traffic)


def families(figures: Iterable[Figure]) -> list[Any]:
    """prometheus_client metric families, one per name (figures of a name share its label names)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: dict[str, Any] = {}
    for f in figures:
        family = out.get(f.name)
        if family is None:
            kind = CounterMetricFamily if f.counter else GaugeMetricFamily
            family = out[f.name] = kind(f.name, f.help, labels=[k for k, _ in f.labels])
        family.add_metric([v for _, v in f.labels], f.value)
    return list(out.values())


def _require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"net.metrics_port: serving metrics needs prometheus_client ({INSTALL}), or set it to 0") \
            from None


class _LoopCollector:
    """Reads the figures on the peer's event loop whenever Prometheus scrapes (from the HTTP thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read: Callable[[], list[Figure]], info: dict[str, str]):
        self.loop, self.read, self.info = loop, read, info

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import InfoMetricFamily

        yield InfoMetricFamily("swarm_peer", "who this peer is", value=self.info)
        done: concurrent.futures.Future[list[Figure]] = concurrent.futures.Future()

        def read() -> None:
            try:
                done.set_result(self.read())
            except Exception as e:  # answered as a failed scrape, not lost in the loop
                done.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(read)
            figures = done.result(READ_TIMEOUT)
        except (RuntimeError, TimeoutError) as e:  # the loop has closed (the peer is leaving), or is stuck
            log.debug("metrics not read: %s", e)
            return
        yield from families(figures)


class MetricsEndpoint:
    """The /metrics endpoint of one peer; does nothing when `net.metrics_port` is 0."""

    def __init__(self, net: NetConfig, role: str):
        """Refuses at once (before the peer joins) where a port is set but prometheus_client is missing."""
        self.host, self.port, self.role = net.host, net.metrics_port, role
        self.run_id = net.run_id
        self._server = None
        if self.port:
            _require_prometheus()

    def start(self, peer_id: str, name: str, read: Callable[[], list[Figure]]) -> None:
        """Serve, from a thread, the figures `read` returns (called on this event loop at each scrape)."""
        if not self.port:
            return
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        info = {"role": self.role, "peer_id": peer_id, "name": name, "run_id": self.run_id}
        registry.register(_LoopCollector(asyncio.get_running_loop(), read, info))
        ProcessCollector(registry=registry)  # memory, CPU seconds, open files of this process
        try:
            self._server, _ = start_http_server(self.port, self.host, registry)
        except OSError as e:
            raise ConfigError(f"net.metrics_port: cannot serve metrics on {self.host}:{self.port} "
                              f"({e.strerror or e}); give each peer on a host a free port of its own") from None
        log.info("%s %s serves metrics on http://%s:%d/metrics", self.role, short(peer_id), self.host, self.port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
