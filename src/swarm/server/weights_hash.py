"""The digest of a stage's weights, computed where the weights live.

Replicas announce this digest at every step, the all-reduce compares it, and a newcomer takes a
downloaded state only if other replicas vouch for its digest (`swarm.core.vouching`). So it must be a
cryptographic hash of the bytes (a hostile replica must not find other weights with the same digest), the
same function on every device (a GPU replica and a CPU replica at one epoch must agree), and cheap enough
to run at every step. It is BLAKE3 of the tensors' bytes laid end to end: on a CPU, the `blake3` package
over the tensors' memory; on a GPU, the same hash computed there by Triton kernels
(`swarm.server.blake3_gpu`), since copying every parameter to the host at every step just to hash it
would cost about as much as the step's all-reduce. Where the kernels cannot run (no Triton, or a GPU
older than Triton supports), a GPU's tensors are copied to the host and hashed there: the same bytes,
slower.
"""

from __future__ import annotations

import logging

import blake3
import torch

log = logging.getLogger(__name__)

# 128 bits: finding other weights with a replica's announced digest (a second preimage) stays out of reach
DIGEST_HEX = 32
_kernels_failed = False  # set once the GPU kernels could not run here: the host hashes from then on


def _on_device(tensors: list[torch.Tensor]) -> bytes | None:
    """BLAKE3 of the tensors computed on their GPU, or None where the kernels cannot run (said once) or the
    GPU has no memory left for their buffers (this time only: the host hashes this digest)."""
    global _kernels_failed
    if _kernels_failed:
        return None
    try:
        from swarm.server.blake3_gpu import stream_hash

        return stream_hash(tensors)
    except torch.cuda.OutOfMemoryError:
        log.warning("the GPU had no memory for the digest's buffers: this digest is computed on the host")
        return None
    except Exception as e:  # ImportError without Triton; a compile error on a GPU Triton does not support
        _kernels_failed = True
        log.warning("the weights' digest is computed on the host from now on: the GPU kernels cannot run "
                    "here (%s: %s)", type(e).__name__, e)
        return None


def digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal digests mean bit-identical tensors."""
    if tensors and tensors[0].device.type == "cuda" and all(t.device == tensors[0].device for t in tensors):
        hashed = _on_device(tensors)
        if hashed is not None:
            return hashed.hex()[:DIGEST_HEX]
    h = blake3.blake3()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:DIGEST_HEX]
