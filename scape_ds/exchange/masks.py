"""Mask selection and index arithmetic: pure tensor functions, no communication.

A mask keeps kc coordinates in every chunk of C elements of a shard. It travels as int16 chunk
offsets (k = n_chunks * kc values, ascending inside each chunk) and is turned into int64 flat
indices only where it is used.
"""
from __future__ import annotations

import torch

__all__ = ["offsets_to_index", "select_mask", "random_offsets"]


def offsets_to_index(offsets: torch.Tensor, chunk_size: int, k_per_chunk: int, base: int = 0) -> torch.Tensor:
    """(n_chunks*kc,) int16 chunk offsets -> (n_chunks*kc,) int64 indices ``base + chunk*C + offset``.

    Works on the concatenated masks of several shards too (chunks are numbered globally).
    """
    n = offsets.numel()
    local = offsets.to(torch.int64) & 0xFFFF  # int16 holds 0..65535 as two's complement
    chunk = torch.arange(n // k_per_chunk, device=offsets.device, dtype=torch.int64).repeat_interleave(k_per_chunk)
    return local + chunk * chunk_size + base


def random_offsets(n_chunks: int, chunk_size: int, k_per_chunk: int, generator: torch.Generator) -> torch.Tensor:
    """kc distinct random offsets per chunk, ascending: (n_chunks*kc,) int16 (CPU generator)."""
    keys = torch.rand(n_chunks, chunk_size, generator=generator)
    offsets = keys.topk(k_per_chunk, dim=1, sorted=False).indices.sort(dim=1).values
    return offsets.reshape(-1).to(torch.int32).to(torch.int16)


def select_mask(
    scores: torch.Tensor,
    chunk_size: int,
    k_per_chunk: int,
    kernels,
    exploration: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose a shard's mask: the kc largest ``|scores|`` of every chunk (SCAPE: scores = momentum).

    With ``exploration`` > 0, ke = round(exploration * kc) offsets of each chunk are drawn at random
    from ``generator`` first, and the remaining kc - ke are the largest |scores| among the others,
    so that coordinates outside the mask keep getting fresh statistics (sparse refresh).

    Returns:
        (S // C * kc,) int16 offsets, ascending inside each chunk.
    """
    ke = round(exploration * k_per_chunk) if exploration > 0 else 0
    if ke == 0 or k_per_chunk == chunk_size:
        return kernels.chunk_topk(scores, chunk_size, k_per_chunk)
    assert generator is not None, "exploration needs a generator every rank seeds alike"
    n_chunks = scores.numel() // chunk_size
    explore = random_offsets(n_chunks, chunk_size, ke, generator).to(scores.device)  # (n_chunks*ke,) int16
    candidates = scores.detach().abs().float()  # (S,) fp32, a copy
    candidates[offsets_to_index(explore, chunk_size, ke)] = -1.0  # below every |score|: never picked twice
    top = candidates.view(n_chunks, chunk_size).topk(k_per_chunk - ke, dim=1, sorted=False).indices
    both = torch.cat([top, (explore.to(torch.int64) & 0xFFFF).view(n_chunks, ke)], dim=1).sort(dim=1).values
    return both.reshape(-1).to(torch.int32).to(torch.int16)
