"""The digest of a stage's weights, computed where the weights live.

Replicas announce this digest at every step, the all-reduce compares it, and a newcomer takes a
downloaded state only if other replicas vouch for its digest (`swarm.core.vouching`). So it must be a
cryptographic hash of the bytes (a hostile replica must not find other weights with the same digest), the
same function on every device (a GPU replica and a CPU replica at one epoch must agree), and cheap enough
to run at every step. It is BLAKE3 of the tensors' bytes laid end to end: on a CPU, the `blake3` package
over the tensors' memory; on a GPU, the same hash computed there by Triton kernels
(`swarm.server.blake3_gpu`), since copying every parameter to the host at every step just to hash it
would cost about as much as the step's all-reduce. Where Triton is missing (torch built without CUDA's
compiler stack), a GPU's tensors are copied to the host and hashed there: the same bytes, slower.
"""

from __future__ import annotations

import blake3
import torch

# 128 bits: finding other weights with a replica's announced digest (a second preimage) stays out of reach
DIGEST_HEX = 32


def _on_gpu(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors all lie on one GPU whose digest Triton can compute there."""
    if not tensors or tensors[0].device.type != "cuda" or any(t.device != tensors[0].device for t in tensors):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal digests mean bit-identical tensors."""
    if _on_gpu(tensors):
        from swarm.server.blake3_gpu import stream_hash

        return stream_hash(tensors).hex()[:DIGEST_HEX]
    h = blake3.blake3()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:DIGEST_HEX]
