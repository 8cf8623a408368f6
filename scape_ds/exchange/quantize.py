"""Coefficient values on the wire in 8 or 4 bits (``scape.value_bits``, basis "dct"; per_rank, and the shared mask).

Each tile's kc sent values are scaled by their largest magnitude (absmax) to signed integers,
q = round(v / s), s = absmax / qmax (qmax = 127 at 8 bits, 7 at 4), and travel as one byte (8 bits)
or one nibble (4 bits) each, offset to be non-negative, followed by the tiles' fp32 scales, in one
uint8 payload. Every rank decodes every payload with the same operations, so all ranks hold the same
values; the sender keeps ``v - q s`` in its error feedback, so what the coding loses is sent later
(sent + kept == accumulated, with the decoded value as what was sent). Bytes per sent coefficient:
4 (fp32) -> 1 + 4 / kc (8 bits) or 0.5 + 4 / kc (4 bits), plus its 2-byte offset.

The symmetric absmax scale per tile is the simplest of the codes the issue names (CCLoco uses a
statistical range and a lookup per bin); a tile of kc values of one sign and similar size loses
little at 8 bits and up to s / 2 per value at 4 bits, which error feedback carries.
"""
from __future__ import annotations

import torch

__all__ = ["payload_numel", "encode_values", "decode_values"]

_QMAX = {8: 127, 4: 7}


def payload_numel(n_values: int, k_per_chunk: int, bits: int) -> int:
    """Bytes of the payload of ``n_values`` (whole tiles of ``k_per_chunk``) at ``bits``."""
    codes = n_values if bits == 8 else (n_values + 1) // 2
    return codes + 4 * (n_values // k_per_chunk)


def encode_values(values: torch.Tensor, k_per_chunk: int, bits: int) -> torch.Tensor:
    """(n_chunks kc,) fp32 values, tile-major -> (payload_numel,) uint8: codes then fp32 scales."""
    qmax = _QMAX[bits]
    tiles = values.view(-1, k_per_chunk)  # (n_chunks, kc)
    scale = tiles.abs().amax(dim=1) / qmax  # (n_chunks,) fp32; 0 for a tile of zeros
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(tiles / safe.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int16) + (qmax + 1)  # 1..2 qmax+1
    codes = codes.reshape(-1).to(torch.uint8)  # (n,)
    if bits == 4:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        pairs = codes.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)  # (ceil(n/2),) two nibbles a byte
    return torch.cat([codes, scale.to(torch.float32).contiguous().view(torch.uint8)])


def decode_values(payload: torch.Tensor, n_values: int, k_per_chunk: int, bits: int) -> torch.Tensor:
    """(payload_numel,) uint8 -> (n_values,) fp32: the values every rank adds (q s)."""
    qmax = _QMAX[bits]
    n_codes = n_values if bits == 8 else (n_values + 1) // 2
    codes, scale = payload[:n_codes], payload[n_codes:].clone().view(torch.float32)  # (n_chunks,) fp32
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)[:n_values]
    q = codes.to(torch.float32) - (qmax + 1)  # (n,) in -qmax..qmax
    return (q.view(-1, k_per_chunk) * scale.unsqueeze(1)).reshape(-1)
