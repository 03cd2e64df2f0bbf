"""The weights' digest is BLAKE3 of their bytes wherever it is computed: the GPU's Triton kernels give
the reference hash's bytes (checked here through Triton's interpreter where Triton is installed, and on
a GPU where one exists), and a digest tells bit-identical weights apart from weights one bit away."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import blake3
import pytest
import torch

from swarm.server import weights_hash
from swarm.server.weights_hash import DIGEST_HEX, digest

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

ROOT = Path(__file__).resolve().parents[2]


def weights(seed: int) -> list[torch.Tensor]:
    """A stage's mix: fp32 matrices, a bf16 tensor of odd length (so the stream is not word-aligned), a scalar."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 70, generator=gen), torch.randn(333, generator=gen).bfloat16(),
            torch.randn(2, 1025, generator=gen), torch.tensor(1.5)]


def reference(tensors: list[torch.Tensor]) -> str:
    h = blake3.blake3(b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors))
    return h.hexdigest()[:DIGEST_HEX]


def test_the_digest_is_blake3_of_the_bytes_end_to_end() -> None:
    assert digest(weights(1)) == reference(weights(1))
    assert digest([]) == blake3.blake3(b"").hexdigest()[:DIGEST_HEX]
    assert len(digest(weights(1))) == 32  # 128 bits: no second preimage within reach


def test_one_bit_changes_the_digest() -> None:
    ours, theirs = weights(2), weights(2)
    assert digest(ours) == digest(theirs)
    theirs[0].view(torch.int32)[123, 45] ^= 1
    assert digest(ours) != digest(theirs)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (CUDA builds of torch bring it)")
def test_the_gpu_kernels_give_the_reference_hash_in_tritons_interpreter() -> None:
    """The edges of BLAKE3's layout (empty, within a block, chunk boundaries, a tree with odd levels,
    windows that end mid-input) and tensors of mixed types laid end to end."""
    script = textwrap.dedent("""
        import blake3, torch
        from swarm.server import blake3_gpu
        blake3_gpu.WINDOW = 3
        gen = torch.Generator().manual_seed(0)
        for n in [0, 65, 1024, 1025, 3 * 1024 + 5, 7 * 1024 + 9]:
            data = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            assert blake3_gpu.stream_hash([data]) == blake3.blake3(data.numpy()).digest(), n
        mixed = [torch.randn(333, generator=gen), torch.randn(10, 7, generator=gen).bfloat16(), torch.randn(999)]
        whole = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in mixed)
        assert blake3_gpu.stream_hash(mixed) == blake3.blake3(whole).digest()
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def test_kernels_that_cannot_run_here_leave_the_digest_to_the_host(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A GPU Triton cannot compile for (older than it supports) makes the first try fail: that is said
    once, and the host hashes from then on instead of the server failing at every step."""
    tries = []

    def failing(tensors):
        tries.append(len(tensors))
        raise RuntimeError("compute capability 6.1 is not supported")

    monkeypatch.setitem(sys.modules, "swarm.server.blake3_gpu", types.SimpleNamespace(stream_hash=failing))
    monkeypatch.setattr(weights_hash, "_kernels_failed", False)
    with caplog.at_level(logging.WARNING, logger="swarm.server.weights_hash"):
        assert weights_hash._on_device(weights(6)) is None
        assert weights_hash._on_device(weights(6)) is None
    assert tries == [4]
    assert [r.getMessage() for r in caplog.records] == [
        "the weights' digest is computed on the host from now on: the GPU kernels cannot run here "
        "(RuntimeError: compute capability 6.1 is not supported)"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_gpu_replica_and_a_cpu_replica_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Computed by the kernels on the GPU: the host's hash, where they could not run, would agree too. The
    kernels are also called alone over windows of three chunks, so the input spans several."""
    from swarm.server import blake3_gpu

    monkeypatch.setattr(weights_hash, "_kernels_failed", False)
    for seed in (3, 4):
        assert digest([w.cuda() for w in weights(seed)]) == digest(weights(seed)) == reference(weights(seed))
    big = [torch.randn(4096, 3000, generator=torch.Generator().manual_seed(5))]  # 48 MiB: deep trees
    assert digest([w.cuda() for w in big]) == digest(big)
    assert not weights_hash._kernels_failed
    monkeypatch.setattr(blake3_gpu, "WINDOW", 3)
    gen = torch.Generator().manual_seed(0)
    for n in [0, 65, 1024, 1025, 3 * 1024 + 5, 7 * 1024 + 9]:
        data = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        assert blake3_gpu.stream_hash([data.cuda()]) == blake3.blake3(data.numpy()).digest(), n


def test_a_gpu_out_of_memory_hashes_that_digest_on_the_host_and_tries_the_gpu_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Memory runs short for a moment (a step's peak, a download's buffers): the kernels are not given up."""
    tries = []

    def short_of_memory(tensors):
        tries.append(len(tensors))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setitem(sys.modules, "swarm.server.blake3_gpu", types.SimpleNamespace(stream_hash=short_of_memory))
    monkeypatch.setattr(weights_hash, "_kernels_failed", False)
    with caplog.at_level(logging.WARNING, logger="swarm.server.weights_hash"):
        assert weights_hash._on_device(weights(6)) is None
        assert weights_hash._on_device(weights(6)) is None
    assert tries == [4, 4] and not weights_hash._kernels_failed
    assert [r.getMessage() for r in caplog.records] == [
        "the GPU had no memory for the digest's buffers: this digest is computed on the host"] * 2
