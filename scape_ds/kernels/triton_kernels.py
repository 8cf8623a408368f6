"""Triton implementations of the SCAPE hot operations (CUDA tensors; CPU under ``TRITON_INTERPRET=1``).

Same signatures and results as ``torch_kernels`` (the oracle), checked against it in
tests/unit/test_kernels.py (interpreter) and tests/gpu/ (CUDA). Differences, by design:
  * ``chunk_topk`` is a radix select on the bits of |score| in a chunk held in registers: four
    passes of a 256-bin histogram of one byte of the keys that still match the threshold's upper
    bytes (``chunk_topk_bitwise``, the first version, made 31 counting passes of one bit each), then
    a prefix sum writes the kept offsets in ascending order. Among equal magnitudes at the threshold
    it keeps the lowest offsets; torch.topk breaks such ties its own way (deterministically, but not
    by offset). NaN scores are kept first (their bits sort above inf).
  * A chunk held in registers stops compiling somewhere above 16384 elements (65536 did not compile
    in 60 s on an H200), so ``chunk_topk`` and the bitmask ``decode_mask`` hand chunks larger than
    ``MAX_TRITON_CHUNK`` to the torch kernels (one warning).
  * ``masked_adams_update`` and ``dense_adams_update`` evaluate the same formula in fp32 registers;
    results agree with the torch kernels to fp32 rounding (a fused multiply-add may differ in the
    last bit).
  * A bf16 error-feedback buffer is accumulated in fp32 and rounded to nearest-even once, as torch does.
The mask of 16-bit offsets needs no kernel: encoding it is a reinterpretation of the bytes.
"""
from __future__ import annotations

import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - triton is an install requirement
    raise ImportError("Triton kernels need triton: pip install 'triton==3.8.0' (or set scape.kernels='torch')") from e

from . import torch_kernels
from .torch_kernels import mask_uses_bitmask

__all__ = [
    "MAX_TRITON_CHUNK",
    "ef_accumulate_pack",
    "chunk_topk",
    "chunk_topk_bitwise",
    "masked_adams_update",
    "dense_adams_update",
    "scatter_values",
    "encode_mask",
    "decode_mask",
    "mask_uses_bitmask",
    "dct_tiles",
    "MAX_TRITON_TILE",
]

_BLOCK = 1024
MAX_TRITON_CHUNK = 16384  # the largest chunk a kernel holds in registers (compiled on an H200)
_WARNED_BIG_CHUNK = False


def _torch_for_big_chunk(chunk_size: int) -> bool:
    """Whether a chunk of ``chunk_size`` goes to the torch kernel (warns once per process)."""
    global _WARNED_BIG_CHUNK
    if chunk_size <= MAX_TRITON_CHUNK:
        return False
    if not _WARNED_BIG_CHUNK:
        warnings.warn(f"scape chunk_size {chunk_size} > {MAX_TRITON_CHUNK}: mask selection uses the torch kernel "
                      f"(slower; a chunk this large does not fit a Triton program)", stacklevel=3)
        _WARNED_BIG_CHUNK = True
    return True


@triton.jit
def _store_kept(key, thr, offs, out_ptr, chunk, KC: tl.constexpr):
    """Store, ascending, the offsets of the KC largest keys of a chunk given the KC-th largest ``thr``
    (every key above it, and the lowest-offset keys equal to it)."""
    greater = key > thr
    need = KC - tl.sum(greater.to(tl.int32), axis=0)  # how many keys equal to thr to keep
    equal = key == thr
    equal_rank = tl.cumsum(equal.to(tl.int32), axis=0)  # 1-based among equals, lowest offset first
    keep = greater | (equal & (equal_rank <= need))
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # ascending output slot of each kept offset
    tl.store(out_ptr + chunk * KC + pos, offs.to(tl.int32), mask=keep)


@triton.jit
def _round_to(x, dst_ty: tl.constexpr):
    """Cast fp32 ``x`` to ``dst_ty`` rounding to nearest-even, as torch does; bf16 by bit arithmetic
    because Triton's interpreter truncates fp32 -> bf16 casts (on GPU the result is the same)."""
    if dst_ty == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dst_ty)


# ------------------------------------------------------------------ error feedback + pack
@triton.jit
def _add_kernel(error_ptr, grad_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    e = tl.load(error_ptr + offs, mask=live)
    if error_ptr.dtype.element_ty == tl.bfloat16:  # a bf16 buffer: add in fp32, round once
        a = _round_to(e.to(tl.float32) + tl.load(grad_ptr + offs, mask=live).to(tl.float32), tl.bfloat16)
    else:
        a = e + tl.load(grad_ptr + offs, mask=live).to(e.dtype)
    tl.store(error_ptr + offs, a, mask=live)


@triton.jit
def _pack_kernel(error_ptr, index_ptr, out_ptr, k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < k
    idx = tl.load(index_ptr + offs, mask=live, other=0)
    a = tl.load(error_ptr + idx, mask=live)
    sent = _round_to(a, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, sent, mask=live)
    if error_ptr.dtype.element_ty == tl.bfloat16:
        residual = _round_to(a.to(tl.float32) - sent.to(tl.float32), tl.bfloat16)
    else:
        residual = a - sent.to(a.dtype)
    tl.store(error_ptr + idx, residual, mask=live)  # rounding residual of the wire dtype


def ef_accumulate_pack(error: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a = error + grad; out = a[index]; error = a - out`` (see ``torch_kernels``). Two launches."""
    n, k = error.numel(), index.numel()
    _add_kernel[(triton.cdiv(n, _BLOCK),)](error, grad, n, BLOCK=_BLOCK)
    if k:
        _pack_kernel[(triton.cdiv(k, _BLOCK),)](error, index, out, k, BLOCK=_BLOCK)
    return out


# ------------------------------------------------------------------ chunk-wise top-k
@triton.jit
def _chunk_topk_kernel(scores_ptr, out_ptr, KC: tl.constexpr, C: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C)
    x = tl.load(scores_ptr + chunk * C + offs).to(tl.float32)
    key = tl.abs(x).to(tl.int32, bitcast=True)  # non-negative floats order like their bits
    bins = tl.arange(0, 256)
    # radix select, one byte at a time from the top: keep the keys whose upper bytes equal the
    # threshold's so far, histogram their next byte, take the largest byte value b such that at
    # least `need` of them have a byte >= b; the keys above b are kept for sure
    thr = tl.zeros((), dtype=tl.int32)
    need = tl.full((), KC, tl.int32)
    for p in tl.static_range(4):
        shift: tl.constexpr = 24 - 8 * p
        digit = (key >> shift) & 255
        if p == 0:
            match = offs >= 0
        else:
            match = (key >> (shift + 8)) == (thr >> (shift + 8))
        hist = tl.histogram(tl.where(match, digit, 0), 256)  # (256,) the others counted in bin 0 ...
        hist = hist - tl.where(bins == 0, C - tl.sum(match.to(tl.int32), axis=0), 0)  # ... and taken out
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # matching keys with byte >= b
        sel = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
        need = need - tl.sum(tl.where(bins > sel, hist, 0), axis=0)
        thr = thr | (sel << shift)
    # thr is now the KC-th largest key
    _store_kept(key, thr, offs, out_ptr, chunk, KC)


@triton.jit
def _chunk_topk_bitwise_kernel(scores_ptr, out_ptr, KC: tl.constexpr, C: tl.constexpr):
    chunk = tl.program_id(0)
    offs = tl.arange(0, C)
    x = tl.load(scores_ptr + chunk * C + offs).to(tl.float32)
    key = tl.abs(x).to(tl.int32, bitcast=True)  # non-negative floats order like their bits
    # radix select: the largest threshold with at least KC keys >= it is the KC-th largest key
    thr = tl.zeros((), dtype=tl.int32)
    for b in tl.static_range(31):
        cand = thr | (1 << (30 - b))
        cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
        thr = tl.where(cnt >= KC, cand, thr)
    _store_kept(key, thr, offs, out_ptr, chunk, KC)


def _num_warps(chunk_size: int) -> int:
    return min(16, max(4, chunk_size // 1024))  # about 32 keys a thread at the larger chunks


def chunk_topk(scores: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """Chunk-wise top-k of ``|scores|`` as (S // C * kc,) int16 offsets, ascending per chunk."""
    if _torch_for_big_chunk(chunk_size):
        return torch_kernels.chunk_topk(scores, chunk_size, k_per_chunk)
    n_chunks = scores.numel() // chunk_size
    out = torch.empty(n_chunks * k_per_chunk, dtype=torch.int32, device=scores.device)  # (k,) int32
    if n_chunks:
        _chunk_topk_kernel[(n_chunks,)](scores.detach().contiguous(), out, KC=k_per_chunk, C=chunk_size,
                                        num_warps=_num_warps(chunk_size))
    return out.to(torch.int16)


def chunk_topk_bitwise(scores: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """The first Triton top-k (31 one-bit counting passes), kept to compare against; same results."""
    n_chunks = scores.numel() // chunk_size
    out = torch.empty(n_chunks * k_per_chunk, dtype=torch.int32, device=scores.device)  # (k,) int32
    if n_chunks:
        _chunk_topk_bitwise_kernel[(n_chunks,)](scores.detach().contiguous(), out, KC=k_per_chunk, C=chunk_size)
    return out.to(torch.int16)


# ------------------------------------------------------------------ masked AdamS
@triton.jit
def _masked_adams_kernel(param_ptr, mom_ptr, index_ptr, grad_ptr, out_ptr, k,
                         lr, beta1, beta2, eps, decay, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < k
    idx = tl.load(index_ptr + offs, mask=live, other=0)
    p = tl.load(param_ptr + idx, mask=live)
    m = tl.load(mom_ptr + idx, mask=live)
    g = tl.load(grad_ptr + offs, mask=live).to(p.dtype)
    p = p * decay
    mc = m / c
    denom = tl.sqrt(mc * mc * beta2 + (1.0 - beta2) * (g * g)) + eps
    m = m * beta1 + (1.0 - beta1) * g
    p = p - (lr / c) * (m / denom)
    tl.store(param_ptr + idx, p, mask=live)
    tl.store(mom_ptr + idx, m, mask=live)
    tl.store(out_ptr + offs, _round_to(p, out_ptr.dtype.element_ty), mask=live)


def masked_adams_update(param, momentum, index, grad, out, *, lr, beta1, beta2, eps, weight_decay, bias_correction):
    """AdamS at ``index`` of the master shard, new values to ``out`` (see ``torch_kernels``)."""
    k = index.numel()
    if k:
        _masked_adams_kernel[(triton.cdiv(k, _BLOCK),)](
            param, momentum, index, grad, out, k, float(lr), float(beta1), float(beta2), float(eps),
            float(1.0 - lr * weight_decay), float(bias_correction), BLOCK=_BLOCK)
    return out


# ------------------------------------------------------------------ dense AdamS (one fused pass)
@triton.jit
def _dense_adams_kernel(param_ptr, mom_ptr, grad_ptr, out_ptr, n, grad_scale,
                        lr, beta1, beta2, eps, decay, c, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    p = tl.load(param_ptr + offs, mask=live)
    m = tl.load(mom_ptr + offs, mask=live)
    g = tl.load(grad_ptr + offs, mask=live).to(p.dtype) * grad_scale
    p = p * decay
    mc = m / c
    denom = tl.sqrt(mc * mc * beta2 + (1.0 - beta2) * (g * g)) + eps
    m = m * beta1 + (1.0 - beta1) * g
    p = p - (lr / c) * (m / denom)
    tl.store(param_ptr + offs, p, mask=live)
    tl.store(mom_ptr + offs, m, mask=live)
    if HAS_OUT:
        tl.store(out_ptr + offs, _round_to(p, out_ptr.dtype.element_ty), mask=live)


def dense_adams_update(param, momentum, grad, out=None, *, grad_scale, lr, beta1, beta2, eps, weight_decay,
                       bias_correction):
    """AdamS over the whole shard in one pass, in place (see ``torch_kernels``): reads p, m, g and
    writes p, m (and ``out``): 20 bytes an fp32 element, against fused AdamW's 28."""
    n = param.numel()
    assert momentum.numel() == n and grad.numel() == n and (out is None or out.numel() == n)
    if n:
        _dense_adams_kernel[(triton.cdiv(n, _BLOCK),)](
            param, momentum, grad, param if out is None else out, n, float(grad_scale), float(lr), float(beta1),
            float(beta2), float(eps), float(1.0 - lr * weight_decay), float(bias_correction),
            HAS_OUT=out is not None, BLOCK=_BLOCK)
    return param


# ------------------------------------------------------------------ scatter of received values
@triton.jit
def _scatter_kernel(dst_ptr, index_ptr, values_ptr, k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < k
    idx = tl.load(index_ptr + offs, mask=live, other=0)
    v = tl.load(values_ptr + offs, mask=live)
    tl.store(dst_ptr + idx, _round_to(v, dst_ptr.dtype.element_ty), mask=live)


def scatter_values(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``dst[index] = values`` (cast to ``dst.dtype``)."""
    k = index.numel()
    if k:
        _scatter_kernel[(triton.cdiv(k, _BLOCK),)](dst, index, values, k, BLOCK=_BLOCK)
    return dst


# ------------------------------------------------------------------ mask encode / decode
@triton.jit
def _encode_bits_kernel(offsets_ptr, words_ptr, k, KC: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < k
    o = tl.load(offsets_ptr + offs, mask=live, other=0).to(tl.int32) & 0xFFFF
    position = (offs // KC) * C + o  # bit position in the whole mask
    bit = (1 << (position % 32)).to(tl.int32)
    tl.atomic_or(words_ptr + position // 32, bit, mask=live)


@triton.jit
def _decode_bits_kernel(bytes_ptr, out_ptr, count_ptr, KC: tl.constexpr, C: tl.constexpr):
    chunk = tl.program_id(0)
    offs = tl.arange(0, C)
    byte = tl.load(bytes_ptr + chunk * (C // 8) + offs // 8).to(tl.int32)
    bit = (byte >> (offs % 8)) & 1
    pos = tl.cumsum(bit, axis=0) - 1
    keep = (bit == 1) & (pos < KC)
    tl.store(out_ptr + chunk * KC + pos, offs, mask=keep)
    tl.store(count_ptr + chunk, tl.sum(bit, axis=0))


def encode_mask(offsets: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """Bitmask (little-endian, C/8 bytes a chunk) or the raw 16-bit offsets, whichever is smaller."""
    if not mask_uses_bitmask(chunk_size, k_per_chunk):
        return offsets.contiguous().view(torch.uint8)
    n_chunks = offsets.numel() // k_per_chunk
    words = torch.zeros(n_chunks * chunk_size // 32, dtype=torch.int32, device=offsets.device)  # (bits/32,)
    k = offsets.numel()
    if k:
        _encode_bits_kernel[(triton.cdiv(k, _BLOCK),)](offsets.contiguous(), words, k, KC=k_per_chunk,
                                                      C=chunk_size, BLOCK=_BLOCK)
    return words.view(torch.uint8)  # little-endian: bit j of word w is bit j%8 of byte 4w + j//8


def decode_mask(encoded: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """Inverse of :func:`encode_mask`: (n_chunks * kc,) int16 offsets, ascending per chunk."""
    if not mask_uses_bitmask(chunk_size, k_per_chunk):
        return encoded.contiguous().view(torch.int16)
    if _torch_for_big_chunk(chunk_size):
        return torch_kernels.decode_mask(encoded, chunk_size, k_per_chunk)
    n_chunks = encoded.numel() * 8 // chunk_size
    out = torch.empty(n_chunks * k_per_chunk, dtype=torch.int32, device=encoded.device)  # (k,) int32
    counts = torch.empty(n_chunks, dtype=torch.int32, device=encoded.device)  # (n_chunks,) bits set
    if n_chunks:
        _decode_bits_kernel[(n_chunks,)](encoded.contiguous(), out, counts, KC=k_per_chunk, C=chunk_size)
        if not bool((counts == k_per_chunk).all()):
            raise RuntimeError(f"corrupt mask: {int(counts.sum())} bits set, "
                               f"expected {n_chunks} chunks x {k_per_chunk}")
    return out.to(torch.int16)


# ------------------------------------------------------------------ 2-D DCT of square tiles (basis "dct")
MAX_TRITON_TILE = 64  # a t x t fp32 tile and Q held in registers: 64 x 64 is 16 KiB each


@triton.jit
def _dct_tiles_kernel(x_ptr, q_ptr, out_ptr, T: tl.constexpr, INVERSE: tl.constexpr):
    # one program per tile: Y = Q X Q^T (INVERSE: X = Q^T Y Q), two tl.dot in fp32 ("ieee": no tf32,
    # so the round trip keeps fp32 accuracy)
    base = tl.program_id(0).to(tl.int64) * T * T
    r = tl.arange(0, T)
    offs = r[:, None] * T + r[None, :]
    x = tl.load(x_ptr + base + offs)
    q = tl.load(q_ptr + offs)
    qt = tl.trans(q)
    if INVERSE:
        y = tl.dot(tl.dot(qt, x, input_precision="ieee"), q, input_precision="ieee")
    else:
        y = tl.dot(tl.dot(q, x, input_precision="ieee"), qt, input_precision="ieee")
    tl.store(out_ptr + base + offs, y)


def dct_tiles(tiles: torch.Tensor, q: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The 2-D orthonormal DCT-II of every tile (see ``torch_kernels.dct_tiles``): one program per
    tile, a batched matmul with the DCT matrix by ``tl.dot``. Tiles of side below 16 (``tl.dot``'s
    minimum) or above ``MAX_TRITON_TILE`` go to the torch kernel."""
    t = tiles.shape[-1]
    if t < 16 or t > MAX_TRITON_TILE or tiles.dtype != torch.float32:
        return torch_kernels.dct_tiles(tiles, q, inverse)
    x = tiles.contiguous()
    out = torch.empty_like(x)  # (n, t, t)
    if x.shape[0]:
        _dct_tiles_kernel[(x.shape[0],)](x, q.contiguous(), out, T=t, INVERSE=inverse)
    return out
