"""BLAKE3 of tensors' bytes computed on the GPU that holds them, with Triton.

BLAKE3 cuts its input into 1 KiB chunks that are compressed independently (16 blocks of 64 bytes each,
one after another), then merges their chaining values pairwise up a binary tree. Here one kernel
compresses every chunk of a window of the input at once, one lane per chunk, and one launch per tree
level merges the pairs: a digest is a few dozen launches, bound by reading the weights once from device
memory, instead of a copy of every parameter to the host. The bytes are those of the reference hash of
the tensors laid end to end (the `blake3` package on a CPU gives the same; tests compare them).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

CHUNK = 1024
WINDOW = 1 << 16  # chunks copied into one zero-padded buffer and compressed per launch: 64 MiB
LANES = 128  # chunks or tree nodes per Triton program


@triton.jit
def _mix(a, b, c, d, x, R1: tl.constexpr, R2: tl.constexpr):
    """Half of BLAKE3's quarter-round: add, xor, rotate right by R1, then by R2 (32-bit words)."""
    a = a + b + x
    d = d ^ a
    d = (d >> R1) | (d << (32 - R1))
    c = c + d
    b = b ^ c
    b = (b >> R2) | (b << (32 - R2))
    return a, b, c, d


@triton.jit
def _g(a, b, c, d, x, y):
    a, b, c, d = _mix(a, b, c, d, x, 16, 12)
    return _mix(a, b, c, d, y, 8, 7)


@triton.jit
def _iv(like):
    """BLAKE3's initial chaining value, a word per lane."""
    z = (like * 0).to(tl.uint32)
    return ((z + 0x6A09E667).to(tl.uint32), (z + 0xBB67AE85).to(tl.uint32), (z + 0x3C6EF372).to(tl.uint32),
            (z + 0xA54FF53A).to(tl.uint32), (z + 0x510E527F).to(tl.uint32), (z + 0x9B05688C).to(tl.uint32),
            (z + 0x1F83D9AB).to(tl.uint32), (z + 0x5BE0CD19).to(tl.uint32))


@triton.jit
def _compress(h0, h1, h2, h3, h4, h5, h6, h7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13,
              m14, m15, t0, t1, block_len, flags):
    """One block's compression into chaining value h0..h7, lane by lane; the new chaining value."""
    v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
    v8, v9, v10, v11, _, _, _, _ = _iv(h0)
    v12, v13, v14, v15 = t0, t1, block_len, flags
    for _ in tl.static_range(7):
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
            m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8)
    return v0 ^ v8, v1 ^ v9, v2 ^ v10, v3 ^ v11, v4 ^ v12, v5 ^ v13, v6 ^ v14, v7 ^ v15


@triton.jit
def _word(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _compress_at(h0, h1, h2, h3, h4, h5, h6, h7, ptr, at, mask, t0, t1, block_len, flags):
    """`_compress` of the 16 words at `ptr + at`, lane by lane."""
    return _compress(
        h0, h1, h2, h3, h4, h5, h6, h7,
        _word(ptr, at, mask), _word(ptr, at + 1, mask), _word(ptr, at + 2, mask), _word(ptr, at + 3, mask),
        _word(ptr, at + 4, mask), _word(ptr, at + 5, mask), _word(ptr, at + 6, mask), _word(ptr, at + 7, mask),
        _word(ptr, at + 8, mask), _word(ptr, at + 9, mask), _word(ptr, at + 10, mask), _word(ptr, at + 11, mask),
        _word(ptr, at + 12, mask), _word(ptr, at + 13, mask), _word(ptr, at + 14, mask),
        _word(ptr, at + 15, mask), t0, t1, block_len, flags)


@triton.jit
def _store(ptr, base, mask, h0, h1, h2, h3, h4, h5, h6, h7):
    tl.store(ptr + base, h0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 1, h1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 2, h2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 3, h3.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 4, h4.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 5, h5.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 6, h6.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptr + base + 7, h7.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _chunks_kernel(words, out, n_chunks, first_chunk, last_len, root_flag, LANES: tl.constexpr):
    """Chaining values of `n_chunks` zero-padded chunks (256 words each), the first being the input's
    chunk `first_chunk`; the last holds `last_len` bytes, and `root_flag` (8) says it is the input's only
    chunk, whose value is then the hash."""
    idx = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = idx < n_chunks
    length = tl.where(idx == n_chunks - 1, last_len, 1024)
    blocks = tl.maximum((length + 63) // 64, 1)
    counter = (first_chunk + idx).to(tl.uint64)
    t0 = counter.to(tl.uint32)
    t1 = (counter >> 32).to(tl.uint32)
    h0, h1, h2, h3, h4, h5, h6, h7 = _iv(t0)
    base = idx.to(tl.int64) * 256
    for b in range(16):
        at = base + b * 16
        last = b == blocks - 1
        block_len = tl.where(last, length - b * 64, 64).to(tl.uint32)
        flags = (tl.where(last, 2 + root_flag, 0) + tl.where(b == 0, 1, 0)).to(tl.uint32)
        o0, o1, o2, o3, o4, o5, o6, o7 = _compress_at(h0, h1, h2, h3, h4, h5, h6, h7, words, at, live, t0, t1,
                                                      block_len, flags)
        active = b < blocks
        h0 = tl.where(active, o0, h0)
        h1 = tl.where(active, o1, h1)
        h2 = tl.where(active, o2, h2)
        h3 = tl.where(active, o3, h3)
        h4 = tl.where(active, o4, h4)
        h5 = tl.where(active, o5, h5)
        h6 = tl.where(active, o6, h6)
        h7 = tl.where(active, o7, h7)
    _store(out, idx.to(tl.int64) * 8, live, h0, h1, h2, h3, h4, h5, h6, h7)


@triton.jit
def _parents_kernel(nodes, out, pairs, flags, LANES: tl.constexpr):
    """Each pair of adjacent chaining values merged into its parent's, with `flags` (12 for the root)."""
    idx = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = idx < pairs
    at = idx.to(tl.int64) * 16
    zero = (idx * 0).to(tl.uint32)
    h0, h1, h2, h3, h4, h5, h6, h7 = _iv(zero)
    o0, o1, o2, o3, o4, o5, o6, o7 = _compress_at(h0, h1, h2, h3, h4, h5, h6, h7, nodes, at, live, zero, zero,
                                                  (zero + 64).to(tl.uint32), (zero + flags).to(tl.uint32))
    _store(out, idx.to(tl.int64) * 8, live, o0, o1, o2, o3, o4, o5, o6, o7)


def _windows(tensors: list[torch.Tensor], total: int, device: torch.device):
    """The tensors' bytes laid end to end, WINDOW chunks at a time, each window zero-padded to whole
    chunks: (first chunk's number, its buffer of 32-bit words)."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    span = WINDOW * CHUNK
    for start in range(0, max(total, 1), span):
        end = min(total, start + span)
        buf = torch.zeros(max(1, -(-(end - start) // CHUNK)) * CHUNK, dtype=torch.uint8, device=device)
        offset = 0
        for v in views:
            lo, hi = max(start, offset), min(end, offset + v.numel())
            if lo < hi:
                buf[lo - start: hi - start] = v[lo - offset: hi - offset]
            offset += v.numel()
        yield start // CHUNK, buf.view(torch.int32)


def stream_hash(tensors: list[torch.Tensor]) -> bytes:
    """BLAKE3 of the tensors' bytes end to end, computed where they are (one device for all). Triton
    launches on the calling thread's current GPU, which is the tensors' only on the compute thread (a
    server's main thread digests too, for its summary)."""
    device = tensors[0].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return _hashed(tensors, device)


def _hashed(tensors: list[torch.Tensor], device: torch.device) -> bytes:
    total = sum(t.numel() * t.element_size() for t in tensors)
    count = max(1, -(-total // CHUNK))
    nodes = torch.empty(count, 8, dtype=torch.int32, device=device)
    for first, words in _windows(tensors, total, device):
        n = words.numel() // 256
        last_len = total - (count - 1) * CHUNK if first + n == count else CHUNK
        _chunks_kernel[(triton.cdiv(n, LANES),)](words, nodes[first:], n, first, last_len, 8 * (count == 1),
                                                 LANES=LANES)
    while nodes.shape[0] > 1:
        pairs = nodes.shape[0] // 2
        merged = torch.empty(pairs + nodes.shape[0] % 2, 8, dtype=torch.int32, device=device)
        flags = 12 if nodes.shape[0] == 2 else 4  # a parent, and the root
        _parents_kernel[(triton.cdiv(pairs, LANES),)](nodes, merged, pairs, flags, LANES=LANES)
        if nodes.shape[0] % 2:
            merged[pairs] = nodes[-1]
        nodes = merged
    return nodes[0].cpu().numpy().astype("<i4").tobytes()
