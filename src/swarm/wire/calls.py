"""The metadata of stage calls, defined once for the trainer that sends them and the server that reads
them. Parsing is strict: metadata comes from an unknown peer, and a field of the wrong type is refused
(`BadRequest`) rather than guessed at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarm.wire.validate import BadRequest


def _field(meta: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = meta.get(name, default)
    if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"{name}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _stage(meta: Any) -> int:
    if not isinstance(meta, dict):
        raise BadRequest("metadata must be a map")
    return _field(meta, "stage", int)


@dataclass(frozen=True)
class StageCall:
    """What a forward or backward request says besides its tensors."""

    req: str  # the microbatch's id, unique per trainer: the server keys it by caller and id
    stage: int
    config: str  # the caller's config hash (swarm.config.config_hash)
    epoch: int = 0  # the stage's epoch as the caller's live view announces it: a replica behind it refuses
    timeout: float = math.inf  # seconds the caller waits for the reply
    deadline: float = math.inf  # the caller's own bound on the wall clock (unix seconds)
    # False: send back the input gradient only (another replica may already hold this microbatch's gradient)
    accumulate: bool = True
    receipt: str = ""  # the trainer's signature on the gradient it hands this server (swarm.net.receipts)

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"req": self.req, "stage": self.stage, "config": self.config, "epoch": self.epoch,
                                "accumulate": self.accumulate}
        meta.update({k: v for k, v in (("timeout", self.timeout), ("deadline", self.deadline)) if math.isfinite(v)})
        if self.receipt:
            meta["receipt"] = self.receipt
        return meta

    @classmethod
    def from_meta(cls, meta: Any) -> StageCall:
        stage = _stage(meta)
        req = meta.get("req")
        if not isinstance(req, str) or not req:
            raise BadRequest("missing request id")
        timeout = float(_field(meta, "timeout", (int, float), math.inf))
        deadline = float(_field(meta, "deadline", (int, float), math.inf))
        return cls(req, stage, _field(meta, "config", str, ""), _field(meta, "epoch", int, 0),
                   timeout if timeout > 0 else math.inf, deadline, _field(meta, "accumulate", bool, True),
                   _field(meta, "receipt", str, ""))


@dataclass(frozen=True)
class StageQuery:
    """A call about a stage rather than a microbatch (`state`, `reduce`): which stage it is for, and, asking
    for a state, whether the caller loads it to serve the stage (a replica catching up or entering it,
    which the replica it asks waits a while for) rather than to hold or export a copy."""

    stage: int
    joining: bool = False

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, **({"joining": True} if self.joining else {})}

    @classmethod
    def from_meta(cls, meta: Any) -> StageQuery:
        return cls(_stage(meta), _field(meta, "joining", bool, False))


@dataclass(frozen=True)
class LedgerQuery:
    """Where a trainer's microbatches stand on a replica (see swarm.core.delivery)."""

    stage: int
    ids: tuple[str, ...]

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, "ids": list(self.ids)}

    @classmethod
    def from_meta(cls, meta: Any) -> LedgerQuery:
        stage, ids = _stage(meta), meta.get("ids")
        if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
            raise BadRequest("ledger takes a list of request ids")
        return cls(stage, tuple(ids))


@dataclass(frozen=True)
class CountNote:
    """A replica's sample count, told straight to the stage's other replicas near a step (`count`), where a
    DHT store would cost every node holding the stage's key. `seq` orders one sender's notes (calls may
    overtake each other)."""

    stage: int
    epoch: int
    pending: int
    seq: int

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, "epoch": self.epoch, "pending": self.pending, "seq": self.seq}

    @classmethod
    def from_meta(cls, meta: Any) -> CountNote:
        stage = _stage(meta)
        values = [_field(meta, name, int) for name in ("epoch", "pending", "seq")]
        if min(values) < 0:
            raise BadRequest("a count note's epoch, samples and sequence number are not negative")
        return cls(stage, *values)
