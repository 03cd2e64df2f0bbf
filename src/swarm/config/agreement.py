"""What every peer of a run must share, and how peers compare it: a digest in every record and call,
and the differing fields named when the digests differ."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from swarm.config.hf import math_settings
from swarm.config.schema import ModelConfig, SwarmConfig
from swarm.wire import PROTOCOL_VERSION


def _plain(section: Any) -> dict[str, Any]:
    """A config section as plain JSON types (tuples become lists), as peers exchange it."""
    return json.loads(json.dumps(dataclasses.asdict(section)))


def model_fingerprint(model: ModelConfig) -> dict[str, Any]:
    """The model fields as plain JSON types: what peers exchange to find what differs.

    A Hugging Face model is compared by every setting of its transformers config that changes what it
    computes (`hf`, named as transformers names them), whichever way each peer configured it (config.json
    or fields), rather than by the `hf_*` fields. Directories are not compared (machines keep files in
    different places), but whether the weights start pretrained is: the replicas of a stage reconcile
    differing weights at their first step by majority, and random weights must never win over a
    checkpoint that way."""
    fields = {k: v for k, v in _plain(model).items() if not k.startswith("hf_")}
    if not model.hf_family:
        return fields
    return {**fields, "hf": math_settings(model), "hf_pretrained": bool(model.hf_weights)}


def agreed(cfg: SwarmConfig) -> dict[str, Any]:
    """Everything the peers of one run must share: the model, the optimizer and its schedule (step
    sizes, batch, mode), and the version of the protocol. Codecs, devices and timeouts may differ
    between peers by design (every tensor says how it is packed)."""
    return {"model": model_fingerprint(cfg.model), "optim": _plain(cfg.optim), "protocol": PROTOCOL_VERSION}


def config_hash(cfg: SwarmConfig) -> str:
    """Short stable digest of `agreed(cfg)`; peers with different digests must not work together."""
    blob = json.dumps(agreed(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Human-readable list of differing fields, e.g. "model.d_model: 128 here, 256 there" (sections are
    flattened into dotted names)."""
    mine, theirs = _flat(mine), _flat(theirs)
    keys = sorted(set(mine) | set(theirs))
    diffs = [f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} there" for k in keys if mine.get(k) != theirs.get(k)]
    return "; ".join(diffs) if diffs else "no field differs"
