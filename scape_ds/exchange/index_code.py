"""In-tile offsets on the wire in Elias-Fano code (``scape.index_code "elias_fano"``, mask "per_rank").

A rank's kc offsets of a tile of C coefficients are distinct and ascending (``chunk_topk``), so they
are a sorted set, which Elias-Fano codes in at most kc (2 + log2(C / kc)) bits, against 16 kc as
int16. Each offset x splits into its l low bits (l = floor(log2(C / kc)), 0 when kc > C / 2) and its
high part h = x >> l; the low bits travel as they are (kc l bits), the high parts as a bitmap of
U = kc + ((C - 1) >> l) + 1 bits with bit h_i + i set for the i-th offset (their gaps in unary).
Every tile's code has the same length, ceil((kc l + U) / 8) bytes, so the ranks' codes travel in one
fixed-size uint8 all-gather, as NCCL and gloo want; on the bench's C = 4096 that is 43 bytes for
kc = 40 (80 as int16), 24 for kc = 20 (40). The code is lossless: decoding gives back the same
offsets, so a run with it is bitwise the run without it, at fewer bytes.

Encode and decode are whole-tensor torch operations (bit planes, a scatter and a batched
``searchsorted`` over the bitmap's running count: no per-tile loop and no host sync, so the same code
runs on CUDA), a block of tiles at a time to bound the bit-plane temporaries.
"""
from __future__ import annotations

import torch

__all__ = ["code_shape", "code_bytes", "encode_offsets", "decode_offsets"]

_BLOCK_TILES = 1 << 14  # tiles coded at once: (tiles, 8 B) uint8 and int32 temporaries


def code_shape(chunk_size: int, k_per_chunk: int) -> tuple[int, int, int]:
    """(l, U, B) of a tile's code: low bits per offset, bitmap bits, bytes per tile."""
    if not 1 <= k_per_chunk <= chunk_size:
        raise ValueError(f"k_per_chunk must be in 1..{chunk_size}, got {k_per_chunk}")
    low = max(0, (chunk_size // k_per_chunk).bit_length() - 1)  # floor(log2(C / kc))
    upper = k_per_chunk + ((chunk_size - 1) >> low) + 1
    return low, upper, (k_per_chunk * low + upper + 7) // 8


def code_bytes(n_chunks: int, chunk_size: int, k_per_chunk: int) -> int:
    """Bytes of the code of ``n_chunks`` tiles' offsets."""
    return n_chunks * code_shape(chunk_size, k_per_chunk)[2]


def encode_offsets(offsets: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """(n_chunks kc,) int16 offsets, ascending and distinct in each tile -> (n_chunks B,) uint8."""
    low, upper, nbytes = code_shape(chunk_size, k_per_chunk)
    x = (offsets.to(torch.int32) & 0xFFFF).view(-1, k_per_chunk)  # (T, kc) in 0..C-1
    out = torch.empty(x.shape[0], nbytes, dtype=torch.uint8, device=offsets.device)  # (T, B)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=offsets.device)
    rank = torch.arange(k_per_chunk, dtype=torch.int32, device=offsets.device)  # (kc,)
    planes = torch.arange(low, dtype=torch.int32, device=offsets.device)  # (l,) bit j of the low part
    for t0 in range(0, x.shape[0], _BLOCK_TILES):
        xs = x[t0 : t0 + _BLOCK_TILES]  # (t, kc)
        bits = torch.zeros(xs.shape[0], 8 * nbytes, dtype=torch.int32, device=offsets.device)  # (t, 8 B)
        bits[:, : k_per_chunk * low] = ((xs.unsqueeze(2) >> planes) & 1).reshape(xs.shape[0], -1)
        bits.scatter_(1, k_per_chunk * low + (xs >> low) + rank, 1)  # bit h_i + i of the bitmap
        out[t0 : t0 + _BLOCK_TILES] = (bits.view(xs.shape[0], nbytes, 8) * weights).sum(2).to(torch.uint8)
    return out.view(-1)


def decode_offsets(code: torch.Tensor, chunk_size: int, k_per_chunk: int) -> torch.Tensor:
    """(n_chunks B,) uint8 from :func:`encode_offsets` -> (n_chunks kc,) int16, the same offsets."""
    low, upper, nbytes = code_shape(chunk_size, k_per_chunk)
    rows = code.view(-1, nbytes)  # (T, B)
    out = torch.empty(rows.shape[0], k_per_chunk, dtype=torch.int16, device=code.device)  # (T, kc)
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=code.device)  # most significant bit first
    powers = torch.ones(low, dtype=torch.int32, device=code.device) << torch.arange(low, dtype=torch.int32,
                                                                                    device=code.device)
    ones = torch.arange(1, k_per_chunk + 1, dtype=torch.int32, device=code.device).expand(1, -1)  # (1, kc)
    rank = ones - 1
    for t0 in range(0, rows.shape[0], _BLOCK_TILES):
        rs = rows[t0 : t0 + _BLOCK_TILES]  # (t, B)
        bits = ((rs.to(torch.int32).unsqueeze(2) >> shifts) & 1).view(rs.shape[0], -1)  # (t, 8 B)
        lows = (bits[:, : k_per_chunk * low].view(rs.shape[0], k_per_chunk, low) * powers).sum(2)  # (t, kc)
        seen = bits[:, k_per_chunk * low : k_per_chunk * low + upper].cumsum(1, dtype=torch.int32)  # (t, U)
        where = torch.searchsorted(seen, ones.expand(rs.shape[0], -1).contiguous(), out_int32=True)  # i-th one
        out[t0 : t0 + _BLOCK_TILES] = (((where - rank) << low) | lows).to(torch.int16)
    return out.view(-1)
