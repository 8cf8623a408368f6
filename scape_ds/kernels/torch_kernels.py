"""Torch implementations of the SCAPE hot operations: the oracle and the CPU path.

Every function here has a Triton twin in ``triton_kernels.py`` with the same signature; the
dispatch in ``scape_ds.kernels`` picks one per device. Shapes use N for a flat buffer, S for one
rank's shard (a multiple of the chunk size C), kc for kept coordinates per chunk and
k = (S // C) * kc for one shard's kept coordinates.

Passes over a whole shard (``dense_adams_update``, ``chunk_topk``) work in blocks of at most
``BLOCK_NUMEL`` elements, so their temporaries are bounded (a few MiB) whatever the shard size:
a step allocates no tensor that grows with the model except where the algorithm needs one.
"""
from __future__ import annotations

import torch

BLOCK_NUMEL = 1 << 18  # elements per block of a whole-shard pass: 1 MiB of fp32 temporaries

__all__ = [
    "BLOCK_NUMEL",
    "ef_accumulate_pack",
    "chunk_topk",
    "masked_adams_update",
    "dense_adams_update",
    "scatter_values",
    "encode_mask",
    "decode_mask",
    "mask_uses_bitmask",
    "dct_tiles",
]


def ef_accumulate_pack(error: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Error feedback accumulate and pack: ``a = error + grad; out = a[index]; error = a - out``.

    ``out`` may have a lower precision than ``error`` (bf16 communication); the rounding residual
    of the sent values stays in ``error`` so nothing is lost. At the kept coordinates the new
    error is exactly that residual (zero when ``out`` is fp32), elsewhere it is ``a``.

    Args:
        error: (N,) fp32 error-feedback buffer, updated in place.
        grad: (N,) local gradient, any float dtype.
        index: (K,) int64 flat indices of the kept coordinates (unique).
        out: (K,) packed outgoing values, written in place (its dtype is the wire dtype).

    Returns:
        ``out``.
    """
    error.add_(grad)
    kept = error.index_select(0, index)  # (K,) fp32
    out.copy_(kept)
    error.index_copy_(0, index, kept - out.to(error.dtype))
    return out


def chunk_topk(scores: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """Chunk-wise top-k of ``|scores|``: the kc largest magnitudes of every chunk of C elements.

    ``torch.topk`` on a (chunks, C) view, a block of at most ``BLOCK_NUMEL`` elements (or one
    chunk) at a time, so the |scores| temporary is bounded.

    Args:
        scores: (S,) float tensor, S a multiple of ``chunk_size``; the magnitude is taken here.
        chunk_size: C, a power of two <= 65536.
        k_per_chunk: kc, 1 <= kc <= C.

    Returns:
        (S // C * kc,) int16 offsets within each chunk (read as uint16 when C = 65536), chunk-major
        and ascending inside each chunk. Ties are broken by torch.topk.
    """
    chunks = scores.detach().view(-1, chunk_size)  # (S/C, C)
    n_chunks = chunks.shape[0]
    if k_per_chunk == chunk_size:
        one = torch.arange(chunk_size, device=scores.device, dtype=torch.int32).to(torch.int16)  # (C,)
        return one.repeat(n_chunks)  # (S,) int16: every offset
    out = torch.empty(n_chunks, k_per_chunk, dtype=torch.int16, device=scores.device)  # (S/C, kc)
    rows = max(1, BLOCK_NUMEL // chunk_size)
    for r0 in range(0, n_chunks, rows):
        block = chunks[r0 : r0 + rows].abs().float()  # (rows, C) fp32 temporary
        top = block.topk(k_per_chunk, dim=1, sorted=False).indices.sort(dim=1).values  # (rows, kc) int64
        out[r0 : r0 + rows] = top.to(torch.int32).to(torch.int16)
    return out.view(-1)


def masked_adams_update(
    param: torch.Tensor,
    momentum: torch.Tensor,
    index: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: float,
) -> torch.Tensor:
    """AdamS update of ``param`` and ``momentum`` at ``index`` only; writes the new values to ``out``.

    With c = ``bias_correction`` (1 - beta1^t, or 1.0 when off), for each kept coordinate i:
      1. ``p_i *= 1 - lr * weight_decay``
      2. ``denom = sqrt(beta2 * (m_i / c)^2 + (1 - beta2) * g_i^2) + eps``
      3. ``m_i = beta1 * m_i + (1 - beta1) * g_i``
      4. ``p_i -= lr * (m_i / c) / denom``; ``out_i = p_i`` cast to ``out.dtype``.

    Args:
        param: (S,) fp32 master shard, updated in place at ``index``.
        momentum: (S,) fp32 momentum shard, updated in place at ``index``.
        index: (k,) int64 local indices into the shard.
        grad: (k,) reduced gradient at ``index`` (any float dtype; computed in ``param.dtype``).
        out: (k,) new parameter values in the compute dtype, written in place.

    Returns:
        ``out``.
    """
    p = param.index_select(0, index)  # (k,) fp32
    m = momentum.index_select(0, index)  # (k,) fp32
    g = grad.to(param.dtype)
    p.mul_(1.0 - lr * weight_decay)
    # the same op sequence (and rounding) as the dense ``adams``: density 1.0 reproduces it bitwise
    denom = m / bias_correction
    denom.mul_(denom).mul_(beta2).add_(g * g, alpha=1.0 - beta2).sqrt_().add_(eps)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    p.addcdiv_(m, denom, value=-lr / bias_correction)
    param.index_copy_(0, index, p)
    momentum.index_copy_(0, index, m)
    out.copy_(p)
    return out


def dense_adams_update(
    param: torch.Tensor,
    momentum: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    grad_scale: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: float,
) -> torch.Tensor:
    """AdamS over a whole flat shard, in place: the dense and refresh steps' update in one pass.

    The update of :func:`masked_adams_update` at every coordinate, with ``g = grad * grad_scale``
    (the 1/D of the mean and the clipping factor folded in, so the reduced gradient is read once
    and never copied). Here in blocks of ``BLOCK_NUMEL`` with the op sequence of
    ``scape_ds.optim.adams``: on one thread the result equals ``adams()`` bitwise when
    ``grad_scale`` is 1 (tests/unit/test_kernels.py); the Triton twin agrees to fp32 rounding.

    Args:
        param: (S,) master shard (fp32, or fp64 for fp64 parameters), updated in place.
        momentum: (S,) momentum, same dtype, updated in place.
        grad: (S,) reduced gradient sum or mean, any float dtype (computed in ``param.dtype``).
        out: optional (S,) compute-dtype copy of the shard (the flat parameters when the master is a
            separate fp32 copy), written with the new values; ``None`` when ``param`` is that copy.
        grad_scale: multiplies ``grad``.

    Returns:
        ``param``.
    """
    n = param.numel()
    assert momentum.numel() == n and grad.numel() == n and (out is None or out.numel() == n)
    c = bias_correction
    for i in range(0, n, BLOCK_NUMEL):
        j = min(n, i + BLOCK_NUMEL)
        p, m = param[i:j], momentum[i:j]  # views
        g = grad[i:j].to(param.dtype)  # (B,) a copy only for another dtype
        if grad_scale != 1.0:
            g = g * grad_scale  # (B,)
        if weight_decay != 0.0:
            p.mul_(1.0 - lr * weight_decay)
        second = m / c  # (B,) the same op sequence (and rounding) as adams()
        second.mul_(second).mul_(beta2)
        second.add_(g * g, alpha=1.0 - beta2)
        second.sqrt_().add_(eps)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        p.addcdiv_(m, second, value=-lr / c)
        if out is not None:
            out[i:j].copy_(p)
    return param


def scatter_values(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``dst[index] = values`` (cast to ``dst.dtype``); the received parameter values of a step.

    Args:
        dst: (N,) flat parameter copy, updated in place.
        index: (K,) int64 unique flat indices.
        values: (K,) new values.

    Returns:
        ``dst``.
    """
    dst.index_copy_(0, index, values.to(dst.dtype))
    return dst


def mask_uses_bitmask(chunk_size: int, k_per_chunk: int) -> bool:
    """True when a bitmask (C/8 bytes a chunk) is smaller than 16-bit offsets (2*kc bytes a chunk)."""
    return chunk_size // 8 < 2 * k_per_chunk


def encode_mask(offsets: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """Encode chunk offsets for the wire: a bitmask or the raw 16-bit offsets, whichever is smaller.

    Args:
        offsets: (n_chunks * kc,) int16 offsets from :func:`chunk_topk` (ascending per chunk).
        chunk_size: C.
        k_per_chunk: kc.

    Returns:
        (n_chunks * C / 8,) uint8 little-endian bitmask if :func:`mask_uses_bitmask`, else the
        (n_chunks * kc * 2,) uint8 bytes of the int16 offsets.
    """
    if not mask_uses_bitmask(chunk_size, k_per_chunk):
        return offsets.contiguous().view(torch.uint8)
    n_chunks = offsets.numel() // k_per_chunk
    local = offsets.view(n_chunks, k_per_chunk).to(torch.int64) & 0xFFFF  # (n_chunks, kc)
    bits = torch.zeros(n_chunks, chunk_size, dtype=torch.uint8, device=offsets.device)
    bits.scatter_(1, local, 1)
    weights = (2 ** torch.arange(8, device=offsets.device, dtype=torch.int32)).to(torch.uint8)
    return (bits.view(-1, 8).to(torch.int32) * weights.to(torch.int32)).sum(1).to(torch.uint8)  # (n_chunks*C/8,)


def decode_mask(encoded: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """Inverse of :func:`encode_mask`: (n_chunks * kc,) int16 offsets, ascending per chunk."""
    if not mask_uses_bitmask(chunk_size, k_per_chunk):
        return encoded.contiguous().view(torch.int16)
    shifts = torch.arange(8, device=encoded.device, dtype=torch.int32)
    bits = (encoded.to(torch.int32).unsqueeze(1) >> shifts) & 1  # (n_bytes, 8)
    bits = bits.view(-1, chunk_size)  # (n_chunks, C)
    n_chunks = bits.shape[0]
    positions = bits.nonzero()[:, 1]  # row-major: chunk-major, ascending in each chunk
    if positions.numel() != n_chunks * k_per_chunk:
        raise RuntimeError(
            f"corrupt mask: {positions.numel()} bits set, expected {n_chunks} chunks x {k_per_chunk}"
        )
    return positions.to(torch.int32).to(torch.int16)


def dct_tiles(tiles: torch.Tensor, q: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The 2-D orthonormal DCT-II of every tile, ``Q X Q^T`` (``inverse``: ``Q^T Y Q``).

    Args:
        tiles: (n, t, t) fp32.
        q: (t, t) the DCT-II matrix (``scape_ds.exchange.basis.dct_matrix``).

    Returns:
        (n, t, t) a new tensor.
    """
    if inverse:
        return torch.matmul(torch.matmul(q.t(), tiles), q)  # (n, t, t)
    return torch.matmul(torch.matmul(q, tiles), q.t())  # (n, t, t)
