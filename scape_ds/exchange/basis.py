"""The DCT basis of ``scape.basis = "dct"``: tiles, the orthonormal DCT-II matrix, and the coefficient layout.

Each sparse-exchanged weight (viewed as a matrix ``(shape[0], -1)``) is cut into square tiles of
``t x t`` elements (t = sqrt(chunk_size)); a weight whose sides are not multiples of t is padded with
zeros inside its last row and column of tiles. A tile X has the coefficients ``Q X Q^T``, where Q is
the orthonormal DCT-II matrix of size t (``scipy.fft.dctn(X, norm="ortho")``). The coefficients of
all tiles lie tile after tile in one flat buffer, each tile a chunk of C = t*t elements, so a chunk
never straddles two tiles or two weights; the tile count is padded to a multiple of the data-parallel
size D and shard r is the tiles [r*S/C, (r+1)*S/C): chunks never cross an owner shard. Only that
padding depends on D: a weight's coefficients lie at the same place whatever D (elastic resume,
:mod:`scape_ds.checkpoint.reshard`, moves them element for element).

Q is orthonormal and linear, so ``Q(mean_r g_r) = mean_r Q g_r`` and the error-feedback identity
``sent + kept == accumulated`` holds coefficient by coefficient. The transform itself is a batched
matmul (``kernels.dct_tiles``); this module only lays tiles out and moves them between the flat
parameter-space buffer and the coefficient buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["dct_matrix", "TileLayout", "CoefficientSlice", "to_coefficients", "from_coefficients"]


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix Q of size n: ``Q[k, i] = s_k cos(pi (2i + 1) k / 2n)``,
    ``s_0 = sqrt(1/n)``, ``s_k = sqrt(2/n)``; ``Q @ x`` is ``scipy.fft.dct(x, norm="ortho")``. Built in
    fp64, then cast. Returns (n, n)."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)  # (n, 1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)  # (1, n)
    q = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)  # (n, n)
    q[0] /= math.sqrt(2.0)
    return q.to(dtype=dtype, device=device)


class _OwnerShards:
    """A coefficient buffer of ``numel`` in tiles of ``chunk_size``, owned in ``world_size`` shards."""

    numel: int
    world_size: int
    chunk_size: int

    @property
    def shard_numel(self) -> int:
        """S, the coefficients each rank owns (whole tiles)."""
        return self.numel // self.world_size

    @property
    def n_chunks(self) -> int:
        return self.numel // self.chunk_size


@dataclass(frozen=True)
class TileLayout(_OwnerShards):
    """Where each weight's tiles lie in the coefficient buffer.

    Attributes:
        tile: t, the side of a tile (C = t*t elements).
        shapes: each weight as a matrix ``(rows, cols)``.
        offsets: each weight's start in the flat parameter buffer (``FlatLayout.offsets``).
        tile_grid: each weight's tiles ``(rows / t, cols / t)``, rounded up.
        coef_offsets: each weight's first coefficient in the coefficient buffer.
        numel: the coefficient buffer's length, D * S (a multiple of D * C).
        world_size: D.
    """

    tile: int
    shapes: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    tile_grid: tuple[tuple[int, int], ...]
    coef_offsets: tuple[int, ...]
    numel: int
    world_size: int

    @classmethod
    def build(cls, tensors: list[torch.Tensor], offsets, world_size: int, tile: int) -> "TileLayout":
        shapes = tuple((t.shape[0], t.numel() // t.shape[0]) for t in tensors)
        grid = tuple((-(-r // tile), -(-c // tile)) for r, c in shapes)
        coef_offsets, acc = [], 0
        for gr, gc in grid:
            coef_offsets.append(acc)
            acc += gr * gc * tile * tile
        quantum = world_size * tile * tile
        numel = max(quantum, -(-acc // quantum) * quantum)
        return cls(tile, shapes, tuple(offsets), grid, tuple(coef_offsets), numel, world_size)

    @property
    def chunk_size(self) -> int:
        return self.tile * self.tile

    @property
    def tiles_numel(self) -> int:
        """The coefficients of the weights' own tiles (``numel`` less the padding tiles): the same at
        every D, so the first ``tiles_numel`` coefficients mean the same thing at every D."""
        if not self.tile_grid:
            return 0
        (gr, gc), t = self.tile_grid[-1], self.tile
        return self.coef_offsets[-1] + gr * gc * t * t

    def node_slice(self, node_size: int) -> "CoefficientSlice":
        """Under ``hierarchy "node"`` (G = ``node_size`` ranks per node, M = D / G nodes): the layout of
        the slice local rank l exchanges across nodes, the coefficients ``[l numel/G, (l+1) numel/G)``:
        M owner shards of S each, whole tiles (``numel`` is a multiple of D C, so of G M C)."""
        if self.world_size % node_size:
            raise ValueError(f"{self.world_size} data-parallel ranks do not split into nodes of {node_size}")
        return CoefficientSlice(self.chunk_size, self.numel // node_size, self.world_size // node_size)


@dataclass(frozen=True)
class CoefficientSlice(_OwnerShards):
    """A contiguous run of whole tiles of a coefficient buffer, exchanged over ``world_size`` owners:
    what the exchange needs of a :class:`TileLayout` (``chunk_size``, ``numel``, ``shard_numel``,
    ``n_chunks``), without the weights."""

    chunk_size: int
    numel: int
    world_size: int


def _weights(layout: TileLayout, weights: range | None):
    """(shape, flat offset, tile grid, coefficient offset) of each weight in ``weights`` (default: all)."""
    rows = list(zip(layout.shapes, layout.offsets, layout.tile_grid, layout.coef_offsets))
    return rows if weights is None else rows[weights.start : weights.stop]


def to_coefficients(layout: TileLayout, flat: torch.Tensor, out: torch.Tensor, q: torch.Tensor, kernels,
                    decay: float | None = None, weights: range | None = None) -> None:
    """Write the tile coefficients of every weight in ``flat`` ((N_pad,) parameter space) into ``out``
    ((layout.numel,) fp32, the padding tiles untouched); with ``decay``, accumulate instead:
    ``out = decay * out + Q flat`` (error feedback). ``weights``: only these weights (a range of their
    indices). Temporaries: one weight's tiles at a time."""
    t = layout.tile
    for (r, c), off, (gr, gc), coff in _weights(layout, weights):
        x = flat[off : off + r * c].view(r, c).to(out.dtype)  # (r, c)
        if (gr * t, gc * t) != (r, c):
            x = F.pad(x, (0, gc * t - c, 0, gr * t - r))  # (gr t, gc t) zeros outside the weight
        tiles = x.view(gr, t, gc, t).permute(0, 2, 1, 3).reshape(gr * gc, t, t)  # (tiles, t, t) a copy
        dst = out[coff : coff + gr * gc * t * t].view(gr * gc, t, t)  # (tiles, t, t) view
        if decay is None:
            dst.copy_(kernels.dct_tiles(tiles, q, inverse=False))
        else:
            if decay != 1.0:
                dst.mul_(decay)
            dst.add_(kernels.dct_tiles(tiles, q, inverse=False))


def from_coefficients(layout: TileLayout, coef: torch.Tensor, out: torch.Tensor, q: torch.Tensor, kernels,
                      weights: range | None = None, coef_base: int = 0, out_base: int = 0) -> None:
    """Decode ``coef`` ((layout.numel,) fp32) into parameter space: each weight's inverse transform,
    cropped to the weight, written into its range of ``out`` ((N_pad,), its padding untouched).
    ``weights``: only these weights; ``coef`` and ``out`` then may hold just their part, starting at
    coefficient ``coef_base`` and flat offset ``out_base``."""
    t = layout.tile
    for (r, c), off, (gr, gc), coff in _weights(layout, weights):
        coff, off = coff - coef_base, off - out_base
        y = coef[coff : coff + gr * gc * t * t].view(gr * gc, t, t)  # (tiles, t, t) view
        x = kernels.dct_tiles(y, q, inverse=True).view(gr, gc, t, t).permute(0, 2, 1, 3).reshape(gr * t, gc * t)
        out[off : off + r * c].view(r, c).copy_(x[:r, :c])
