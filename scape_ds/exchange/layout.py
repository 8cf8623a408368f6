"""Flat, padded, sharded layout of a list of parameters over a data-parallel group.

The sparse parameters of one param group are laid end to end in one flat buffer of N elements,
padded to N_pad = D * S where the shard size S is a multiple of the chunk size C. Data-parallel
rank r owns the contiguous shard [r*S, (r+1)*S) of every flat buffer (parameters, gradients,
error feedback), as a ZeRO-1 partition does (:class:`FlatLayout`, path A). :class:`Zero3Layout`
describes path B's: ZeRO-3's parameters in its flat order and sub-groups, as a checkpoint re-sharded
for another data-parallel size needs them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FlatLayout", "Zero3Layout", "split_dense_sparse", "is_dense_tensor"]


def is_dense_tensor(shape: tuple[int, ...], numel: int, dense_numel_threshold: int, marked: bool = False) -> bool:
    """Whether a tensor is exchanged densely on both paths: 1-D (norms, biases), fewer than
    ``dense_numel_threshold`` elements, or ``marked`` (``scape_dense``). ZeRO-3 passes the full
    ``ds_shape``/``ds_numel``, since its parameters hold only their partition."""
    return len(shape) < 2 or numel < dense_numel_threshold or marked


def split_dense_sparse(params: list[torch.Tensor], dense_numel_threshold: int) -> tuple[list, list]:
    """Split into (sparse, dense) by :func:`is_dense_tensor`."""
    sparse = [p for p in params
              if not is_dense_tensor(p.shape, p.numel(), dense_numel_threshold, getattr(p, "scape_dense", False))]
    ids = {id(p) for p in sparse}
    return sparse, [p for p in params if id(p) not in ids]


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of each tensor in the flat buffer, and the shard geometry.

    Attributes:
        numels: elements of each tensor, in order.
        offsets: start of each tensor in the flat buffer.
        numel: N, the elements of all tensors.
        shard_numel: S, elements per rank (a multiple of ``chunk_size``).
        world_size: D.
        chunk_size: C.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    shard_numel: int
    world_size: int
    chunk_size: int

    @classmethod
    def build(cls, tensors: list[torch.Tensor], world_size: int, chunk_size: int) -> "FlatLayout":
        numels = tuple(t.numel() for t in tensors)
        offsets, acc = [], 0
        for n in numels:
            offsets.append(acc)
            acc += n
        quantum = world_size * chunk_size
        padded = max(quantum, -(-acc // quantum) * quantum)
        return cls(numels, tuple(offsets), acc, padded // world_size, world_size, chunk_size)

    @property
    def padded_numel(self) -> int:
        """N_pad = D * S."""
        return self.shard_numel * self.world_size

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_numel // self.chunk_size

    def shard_slice(self, rank: int) -> slice:
        """The flat range rank ``rank`` owns."""
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)


@dataclass(frozen=True)
class Zero3Layout:
    """Path B's sibling of :class:`FlatLayout`: what re-sharding needs of the loading engine's ZeRO-3
    layout (built by :func:`scape_ds.zero3.zero3_layout`, read by :mod:`scape_ds.checkpoint.reshard`).

    Attributes:
        numels: every parameter's number of elements, in ZeRO-3's flat order (sub-group by sub-group,
            each in its param group's order: the order of the checkpoint's ``param_shapes``).
        sub_groups: the number of parameters of each sub-group (one fp32 flat partition each), in order.
        param_group_of: the optimizer param group of each sub-group.
        ds_order: for the i-th parameter in ds_id order (SCAPE's keys), its index in the flat order.
    """

    numels: tuple[int, ...]
    sub_groups: tuple[int, ...]
    param_group_of: tuple[int, ...]
    ds_order: tuple[int, ...]
