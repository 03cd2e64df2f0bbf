"""What peers publish in the DHT, and strict parsing of what others published.

A stage is one DHT key with one subkey per server, so a single `get` lists the stage. Values are
small dicts (far below the DHT's ~64 KiB limit). Anything malformed is dropped by the reader, never
trusted: a record is data from an unknown peer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class RecordError(ValueError):
    """A DHT value does not have the shape of a record."""


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}_stage{stage}"


def trainers_key(run_id: str) -> str:
    return f"{run_id}_trainers"


def backup_key(run_id: str, stage: int) -> str:
    return f"{run_id}_backup{stage}"


def _fields_from(cls: type, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"expected a dict, got {type(value).__name__}")
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "peer_id":
            continue
        if f.name not in value:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise RecordError(f"missing field {f.name!r}")
        v = value[f.name]
        expected = {"int": int, "float": (int, float), "str": str, "bool": bool, "dict": dict}[str(f.type)]
        if not isinstance(v, expected) or (f.type == "int" and isinstance(v, bool)):
            raise RecordError(f"field {f.name!r} has type {type(v).__name__}")
        out[f.name] = float(v) if f.type == "float" else v
    return out


class _Record:
    """A DHT value keyed by the publishing peer's id (the subkey), so the id is not repeated inside."""

    def to_value(self) -> dict[str, Any]:
        value = dataclasses.asdict(self)
        del value["peer_id"]
        return value


@dataclass(frozen=True)
class ServerRecord(_Record):
    """A stage server's announcement: enough to route to it and to coordinate its stage's steps."""

    peer_id: str
    stage: int
    throughput: float  # samples/s of forward+backward, measured over the last few seconds (for routing)
    queue: int  # requests waiting for compute
    epoch: int  # optimizer steps this replica has applied
    pending: int  # samples accumulated toward the next step
    config_hash: str  # digest of what every peer of the run must share (swarm.config.agreed)
    model: dict  # the model config, so a mismatch can be explained field by field
    gone: bool = False  # tombstone written on graceful exit
    capacity: float = 0.0  # the same over a longer window, first calls left out (for rebalancing)
    tenure: float = 0.0  # seconds this server has served this stage (rebalancing waits for settled ones)
    moving: bool = False  # finishing its work here before it moves to another stage: route new work elsewhere
    name: str = ""  # the operator's label for the server, if any
    optim: dict = dataclasses.field(default_factory=dict)  # the optimizer config, likewise
    protocol: int = 0  # swarm.wire.PROTOCOL_VERSION of the writer (0: one from before versions)
    # unix time at which its operator started this replica's stage afresh mid-run, its training lost (0: never)
    fresh: float = 0.0

    def agreed(self) -> dict[str, Any]:
        """What the writer hashed into `config_hash` (see swarm.config.agreed), to name what differs."""
        return {"model": self.model, "optim": self.optim, "protocol": self.protocol}

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> ServerRecord:
        fields = _fields_from(cls, value)
        if min(fields["stage"], fields["epoch"], fields["pending"], fields["queue"], fields.get("tenure", 0)) < 0:
            raise RecordError("negative counter")
        return cls(peer_id=peer_id, **fields)


@dataclass(frozen=True)
class TrainerRecord(_Record):
    """A trainer's progress, read by servers (to know when the run's last samples are in) and launchers."""

    peer_id: str
    completed: int  # samples whose backward reached stage 0
    failed: int  # microbatches given up after all retries
    loss: float  # recent mean loss
    done: bool  # the trainer has stopped sending work and drained what it had in flight
    samples_per_second: float = 0.0  # completed over the last trainer.progress_every seconds (0 from old peers)

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> TrainerRecord:
        return cls(peer_id=peer_id, **_fields_from(cls, value))


@dataclass(frozen=True)
class BackupRecord(_Record):
    """A copy of a stage's state held outside the stage (see swarm.core.backups), announced by its holder."""

    peer_id: str
    stage: int
    epoch: int  # the copy's epoch
    seen: int  # the newest epoch of the stage the holder has seen (the copy is this many steps behind it)
    config_hash: str
    megabytes: float = 0.0

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> BackupRecord:
        fields = _fields_from(cls, value)
        if min(fields["stage"], fields["epoch"]) < 0 or fields["seen"] < fields["epoch"]:
            raise RecordError("negative counter, or a copy newer than its stage")
        return cls(peer_id=peer_id, **fields)
