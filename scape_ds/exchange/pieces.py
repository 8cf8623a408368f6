"""Index arithmetic of the ZeRO-3 exchange: pieces, masks, rank-major packing (pure tensor functions).

ZeRO-3 partitions every parameter of ``numel`` elements into D pieces of P = ceil(numel / D)
elements, the last padded; rank r owns piece r, elements ``[r*P, (r+1)*P)`` of the flattened
parameter. A mask keeps k of the P positions of every piece: a (D, k) int64 tensor of offsets
within each piece, row r chosen by rank r. The buffers the collectives carry are rank-major: the
D rows of every parameter side by side, row r the part rank r receives or sent
(docs/design.md section 2).
"""
from __future__ import annotations

import math
from typing import Hashable, Iterable, Sequence

import torch

__all__ = ["piece_numel", "k_per_piece", "real_numel", "pack_for_reduce_scatter", "unpack_pieces",
           "split_rank_major", "replica_positions", "flat_indices"]


def piece_numel(numel: int, world_size: int) -> int:
    """P: elements of each rank's piece of a parameter of ``numel`` elements (the last piece padded)."""
    return math.ceil(numel / world_size)


def k_per_piece(piece: int, sparsity: float) -> int:
    """k: kept positions of a piece of ``piece`` elements at ``sparsity`` (at least 1)."""
    return max(1, math.ceil((1.0 - sparsity) * piece))


def real_numel(numel: int, piece: int, rank: int) -> int:
    """How many of rank ``rank``'s ``piece`` elements are the parameter's (the rest is padding)."""
    return max(0, min(piece, numel - rank * piece))


def pack_for_reduce_scatter(accs: Sequence[torch.Tensor],
                            masks: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Pack error-feedback-corrected gradients for one reduce-scatter; what is packed leaves ``accs``.

    Args:
        accs: per parameter a (D, P_i) view of its error feedback ``E + g`` (zeroed in place where
            it is packed: everything when dense, the mask when sparse).
        masks: per parameter its (D, k_i) int64 mask; ``None``: a dense step.

    Returns:
        ``(packed, widths)``: (D * sum w_i,) rank-major values (row r: rank r's piece of every
        parameter, the whole piece when dense, the values at row r of its mask when sparse) and
        the width w_i (P_i or k_i) of each parameter in a row.
    """
    if masks is None:
        packed = torch.cat(list(accs), dim=1).reshape(-1)  # (D * sum P,), a copy
        for a in accs:
            a.zero_()
        return packed, [a.shape[1] for a in accs]
    vals = [a.gather(1, m) for a, m in zip(accs, masks)]  # (D, k_i) each
    for a, m in zip(accs, masks):
        a.scatter_(1, m, 0.0)
    return torch.cat(vals, dim=1).reshape(-1), [m.shape[1] for m in masks]  # (D * sum k,)


def unpack_pieces(row: torch.Tensor, widths: Sequence[int], pieces: Sequence[int],
                  mask_rows: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """This rank's row of a rank-major buffer -> per parameter its (P_i,) piece.

    Args:
        row: (sum w_i,) what the reduce-scatter delivered to this rank.
        widths: w_i as :func:`pack_for_reduce_scatter` returned them.
        pieces: P_i.
        mask_rows: per parameter this rank's (k_i,) mask row; ``None``: a dense step (w_i = P_i).

    Returns:
        (P_i,) tensors: the values, zero outside the mask on a sparse step.
    """
    chunks = torch.split(row, list(widths))
    if mask_rows is None:
        return list(chunks)
    out = []
    for chunk, m, P in zip(chunks, mask_rows, pieces):
        part = torch.zeros(P, dtype=chunk.dtype, device=chunk.device)
        part[m] = chunk
        out.append(part)
    return out


def split_rank_major(gathered: torch.Tensor, widths: Sequence[int], world_size: int) -> tuple[torch.Tensor, ...]:
    """(D * sum w_i,) all-gathered rank-major values -> per parameter a (D, w_i) view, row r from rank r."""
    return torch.split(gathered.view(world_size, -1), list(widths), dim=1)


def replica_positions(mask: torch.Tensor, piece: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every rank's mask lands in the flattened full parameter.

    Args:
        mask: (D, k) int64 offsets within each rank's piece.
        piece: P.
        numel: the parameter's elements (positions at or past it are the last piece's padding).

    Returns:
        ``(positions, valid)``: (n_valid,) int64 flat positions of the real entries, and the
        (D * k,) bool mask of which entries of ``mask.reshape(-1)`` they are.
    """
    D = mask.shape[0]
    flat = (torch.arange(D, device=mask.device).unsqueeze(1) * piece + mask).reshape(-1)  # (D * k,)
    valid = flat < numel
    return flat[valid], valid


def flat_indices(entries: Iterable[tuple[Hashable, int, torch.Tensor]]) -> dict[Hashable, torch.Tensor]:
    """This rank's mask as indices into the flat partitions that hold its pieces.

    Args:
        entries: ``(key of the flat partition, offset of the piece in it, (k,) mask row)`` per
            parameter, in the partition's order.

    Returns:
        key -> (sum k,) int64 indices into that flat partition.
    """
    index: dict[Hashable, list] = {}
    for key, offset, row in entries:
        index.setdefault(key, []).append(row + offset)
    return {k: torch.cat(v) for k, v in index.items()}
