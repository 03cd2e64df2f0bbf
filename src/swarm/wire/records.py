"""What peers publish in the DHT, and strict parsing of what others published.

A stage is one DHT key with one subkey per server, so a single `get` lists the stage. Values are
small dicts (far below the DHT's ~64 KiB limit). Anything malformed is dropped by the reader, never
trusted: a record is data from an unknown peer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from swarm.core.dataplan import Claim, merged


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
    # of the weights it holds at `epoch` (swarm.server.state_io.digest): downloaders of a replica's state take
    # it only where other replicas vouch for its digest (swarm.core.vouching); not part of the agreed config
    digest: str = ""
    # the stage this server served before it moved to this one (-1: none, it joined here); the move itself
    # was `tenure` seconds ago
    previous_stage: int = -1
    calls: int = 0  # calls received and not yet answered, whatever they wait on (`queue` counts compute only)

    def agreed(self) -> dict[str, Any]:
        """What the writer hashed into `config_hash` (see swarm.config.agreed), to name what differs."""
        return {"model": self.model, "optim": self.optim, "protocol": self.protocol}

    @classmethod
    def from_value(cls, peer_id: str, value: Any) -> ServerRecord:
        fields = _fields_from(cls, value)
        if min(fields["stage"], fields["epoch"], fields["pending"], fields["queue"], fields.get("tenure", 0),
               fields.get("calls", 0)) < 0:
            raise RecordError("negative counter")
        if fields.get("previous_stage", -1) < -1:
            raise RecordError("previous_stage below -1")
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
    val_loss: float = math.nan  # its latest loss on the held-out samples (trainer.eval_every; NaN: none yet)
    val_step: int = -1  # the stages' step when that validation loss was taken

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


def data_key(run_id: str, corpus: str, pass_: int, group: int) -> str:
    """The DHT key listing one group of a pass's blocks (see swarm.core.dataplan). `corpus` names the
    sample order (corpus size, seed, block size): trainers that cut the data differently never share keys."""
    return f"{run_id}_data_{corpus}_p{pass_}_g{group}"


MAX_RANGES = 256  # consumed ranges one block record may list (they merge as microbatches complete in order)


def block_value(claim: Claim) -> dict[str, Any]:
    return {"owner": claim.owner, "lease_until": claim.lease_until, "size": claim.size,
            "done": [list(r) for r in claim.done]}


def block_from_value(subkey: str, value: Any) -> tuple[int, Claim]:
    """A block's number (the subkey) and its claim, as published by some trainer."""
    if not (subkey.isascii() and subkey.isdigit()):
        raise RecordError(f"block subkey {subkey!r} is not a block number")
    if not isinstance(value, dict):
        raise RecordError(f"expected a dict, got {type(value).__name__}")
    owner, lease, size, done = (value.get(k) for k in ("owner", "lease_until", "size", "done"))
    if not isinstance(owner, str) or not isinstance(lease, (int, float)) or isinstance(lease, bool) \
            or not math.isfinite(lease):
        raise RecordError("owner or lease_until malformed")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise RecordError("size malformed")
    if not isinstance(done, list) or len(done) > MAX_RANGES:
        raise RecordError("done malformed")
    ranges: tuple[tuple[int, int], ...] = ()
    for r in done:
        if (not isinstance(r, list) or len(r) != 2 or any(not isinstance(x, int) or isinstance(x, bool) for x in r)
                or not 0 <= r[0] < r[1] <= size):
            raise RecordError(f"range {r!r} malformed")
        ranges = merged(ranges, (r[0], r[1]))
    return int(subkey), Claim(owner, float(lease), ranges, size)
