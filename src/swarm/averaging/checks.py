"""What a member of a stage's all-reduce accepts from the others, checked before any of it is used: a
contribution (its part of a member's gradient sum, the samples and microbatches it claims) and an
owner's answer (the reduced part). One hostile or broken member must not poison the step."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from swarm.net.directory import short
from swarm.net.receipts import receipt_valid
from swarm.wire.validate import BadRequest, all_finite

POISON = "poisoned:"  # marks a refusal of a contribution that is not finite or over its bound
MAX_GROUP = 256  # members a proposed group may list
MAX_IDS = 1 << 16  # microbatch ids one contribution may list
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class Bounds:
    """What one member's contribution may hold (0: no bound)."""

    max_norm_per_sample: float = 0.0  # L2 norm of its part divided by its samples
    samples_per_id: int = 0  # samples per microbatch it lists
    # robust aggregation: each contribution's norm per sample is clipped to this many times the group's
    # median (0: the plain mean); with three or more members, one hostile member's pull is bounded
    clip_to_median: float = 0.0
    # every listed microbatch must come with its trainer's receipt for the sender (swarm.net.receipts), and
    # the receipts' samples must add up to the claimed samples. Stage servers always check; off only where
    # the members are not fed by trainers (the arithmetic's own tests)
    receipts: bool = False

    def clip_scales(self, contributions: dict[str, tuple[torch.Tensor, int, list[str]]]
                    ) -> tuple[dict[str, float], float]:
        """How much each member's part counts (1: whole), and the norm per sample parts are clipped to."""
        if not self.clip_to_median or len(contributions) < 3:
            return dict.fromkeys(contributions, 1.0), math.inf
        norms = {m: float(torch.linalg.vector_norm(p)) / max(n, 1) for m, (p, n, _) in contributions.items()}
        cap = self.clip_to_median * statistics.median(norms.values())
        return {m: min(1.0, cap / v) if v > 0 else 1.0 for m, v in norms.items()}, cap


@dataclass(frozen=True)
class Contribution:
    """One member's part of a round, as its `reduce` call carries it."""

    sender: str
    epoch: int
    group: tuple[str, ...]
    samples: int
    ids: list[str]
    digest: str  # of the sender's weights, which must equal the owner's
    part: torch.Tensor

    @classmethod
    def parse(cls, meta: dict[str, Any], tensors: list[torch.Tensor], sender: str, bounds: Bounds) -> Contribution:
        if not isinstance(meta, dict):
            raise BadRequest("malformed reduce request: metadata must be a map")
        epoch, group, samples, ids = (meta.get(k) for k in ("epoch", "group", "samples", "ids"))
        ids = [] if ids is None else ids
        if not (is_int(epoch) and is_int(samples) and isinstance(group, list) and isinstance(ids, list)):
            raise BadRequest("malformed reduce request: epoch, samples, group or ids missing or mistyped")
        if not (len(group) <= MAX_GROUP and len(ids) <= MAX_IDS
                and all(isinstance(p, str) and len(p) <= MAX_ID_CHARS for p in (*group, *ids))):
            raise BadRequest("malformed reduce request: group and ids must list at most "
                             f"{MAX_GROUP} and {MAX_IDS} short strings")
        if samples < 0 or (bounds.samples_per_id and samples > len(ids) * bounds.samples_per_id):
            raise BadRequest(f"{POISON} reduce request claims {samples} samples for {len(ids)} microbatch(es)")
        if sender not in group or len(tensors) != 1:
            raise BadRequest("reduce request from outside its own group")
        part = tensors[0]
        if not all_finite(part):
            raise BadRequest(f"{POISON} part from {short(sender)} holds NaN or Inf")
        if bounds.max_norm_per_sample and (
                norm := float(torch.linalg.vector_norm(part.float())) / max(samples, 1)) > bounds.max_norm_per_sample:
            raise BadRequest(f"{POISON} part from {short(sender)} has norm {norm:.3g} per sample, over the bound "
                             f"of {bounds.max_norm_per_sample:.3g}")
        return cls(sender, epoch, tuple(group), samples, ids, str(meta.get("digest", "")), part)


def check_receipts(receipts: Any, c: Contribution, stage: int) -> None:
    """Refuse, as poison, a contribution listing a microbatch without the receipt its trainer gave the
    sender, or samples its receipts do not show. One signature check per microbatch: run off the event
    loop for long lists."""
    if not (isinstance(receipts, list) and len(receipts) == len(c.ids)):
        raise BadRequest(f"{POISON} {short(c.sender)} lists microbatches without a receipt for each")
    total = 0
    for req_id, entry in zip(c.ids, receipts, strict=True):
        if not (isinstance(entry, list) and len(entry) == 2 and is_int(entry[0]) and entry[0] > 0
                and receipt_valid(entry[1], req_id, stage, c.sender, entry[0])):
            raise BadRequest(f"{POISON} {short(c.sender)} lists microbatch {req_id[-24:]!r} without its trainer's "
                             "receipt")
        total += entry[0]
    if total != c.samples:
        raise BadRequest(f"{POISON} {short(c.sender)} claims {c.samples} samples; its receipts show {total}")


def answer_problem(tensors: list[torch.Tensor], size: int, samples: Any, ids: Any, max_norm: float) -> str | None:
    if len(tensors) != 1:
        return f"{len(tensors)} tensors"
    mean = tensors[0]
    if mean.numel() != size or mean.dtype != torch.float32:
        return f"{mean.numel()} {mean.dtype} values for {size} float32"
    if not all_finite(mean):
        return "NaN or Inf"
    if max_norm and float(torch.linalg.vector_norm(mean)) > max_norm:
        return "a mean over the bound"
    if not (is_int(samples) and samples >= 0 and isinstance(ids, list) and len(ids) <= MAX_IDS
            and all(isinstance(i, str) for i in ids)):
        return "a malformed sample count or id list"
    return None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
