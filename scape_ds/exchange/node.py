"""The node stage of hierarchical SCAPE: dense inside a node, around the sparse exchange across nodes.

docs/design.md, Hierarchical SCAPE. With ``scape.hierarchy = "node"`` the data-parallel group of
D = G M ranks (G per node, M nodes) is split in two: the *node* group (the G ranks of one node, fast
links) and the *cross-node* group of local rank l (rank l of every node, the slow network). The flat
buffer of N_pad = G M S elements is cut into G slices of M S; local rank l is responsible for
slice l. :class:`~scape_ds.optim.ScapeAdamS` runs its flat exchange unchanged over the cross-node
group on slice l, with this stage around it:

  1. before: a dense reduce-scatter of the local gradient over the node group; rank l receives the
     node sum of slice l, (M S,) (:meth:`NodeStage.reduce_grads`);
  2. SCAPE on slice l across nodes (error feedback of M S elements, masks, packed collectives);
  3. after: a packed all-gather over the node group of the new values at every slice's mask
     (:meth:`NodeStage.gather_values`; dense on dense steps, :meth:`NodeStage.gather_params`), so
     every rank of the node holds the same parameters. The slices' masks travel inside the node
     once per refresh (:meth:`NodeStage.node_index`).

:class:`FlatStage` is the same interface doing nothing: a flat run is a one-rank node whose slice is
the whole buffer, without copies. The optimizer chooses one of the two once, at construction.

Under ``basis "dct"`` the slices are of the coefficient buffer (whole tiles; the tile count is a
multiple of G M): each rank transforms its whole local gradient, a dense reduce-scatter over the node
gives local rank l the node sum of slice l's coefficients, which enter its error feedback ((numel/G,)
per rank); the DCT exchange runs on slice l across nodes; an all-gather over the node of what each
rank received (per_rank, :meth:`NodeStage.gather_received`) or of every slice's mean coefficients
(shared, :meth:`NodeStage.gather_coefficients`) gives every rank the whole mean, which it decodes and
applies as a flat run does (:meth:`NodeStage.accumulate_coefficients`).
"""
from __future__ import annotations

import torch

from ..comm import Communicator, all_gather_int16, collective_bytes
from .basis import TileLayout, to_coefficients
from .masks import offsets_to_index

__all__ = ["FlatStage", "NodeStage"]


class FlatStage:
    """No node stage (``hierarchy="flat"``): the slice is the whole buffer and nothing moves."""

    size = 1
    rank = 0
    meter = None

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def grad_buffer(self, flat_grad: torch.Tensor) -> torch.Tensor:
        return flat_grad  # the slice's gradient is the local gradient itself

    def reduce_grads(self, flat_grad: torch.Tensor, grad_slice: torch.Tensor) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        return None

    def all_reduce_across(self, tensor: torch.Tensor, comm: Communicator, tag: str) -> None:
        comm.all_reduce(tensor, tag)

    def broadcast(self, tensor: torch.Tensor, tag: str) -> None:
        return None

    def gather_params(self, flat_param: torch.Tensor, param_slice: torch.Tensor) -> None:
        return None

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def node_index(self, offsets, index, chunk_size, k_per_chunk, kernels) -> torch.Tensor:
        return index

    def dense_bytes(self, padded_numel: int, elem_bytes: int, dense_numel: int) -> int:
        return 0

    def coefficient_layout(self, tiles: TileLayout) -> TileLayout:
        return tiles

    def accumulate_coefficients(self, tiles: TileLayout, grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor,
                                kernels, decay: float) -> None:
        to_coefficients(tiles, grad, error, q, kernels, decay=decay)  # e = decay e + Q g

    def gather_coefficients(self, mean: torch.Tensor) -> torch.Tensor:
        return mean



class NodeStage:
    """Collectives over the node group around the cross-node exchange of slice ``intra.rank``.

    Args:
        intra: the communicator over this node's G data-parallel ranks (its meter counts the
            intra-node bytes; the cross-node communicator's meter the inter-node ones).
    """

    def __init__(self, intra: Communicator):
        self.intra = intra
        self.size, self.rank, self.meter = intra.world_size, intra.rank, intra.meter

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a (G M S,) buffer: a (M S,) view."""
        n = flat.numel() // self.size
        return flat[self.rank * n : (self.rank + 1) * n]

    def grad_buffer(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """The node sum of this rank's slice lands here: (M S,) in the compute dtype, N/G per rank."""
        return torch.zeros(flat_grad.numel() // self.size, dtype=flat_grad.dtype, device=flat_grad.device)

    def reduce_grads(self, flat_grad: torch.Tensor, grad_slice: torch.Tensor) -> None:
        """Step 1: ``grad_slice`` (M S,) = sum over the node of slice ``rank`` of ``flat_grad`` (G M S,)."""
        self.intra.reduce_scatter(grad_slice, flat_grad, "grad_rs")

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        """Sum over the node (dense tensors and norms: the cross-node sum follows or came first)."""
        self.intra.all_reduce(tensor, tag)

    def all_reduce_across(self, tensor: torch.Tensor, comm: Communicator, tag: str) -> None:
        """Sum ``tensor`` ((n,), e.g. the dense tensors' gradients) over every rank of every node, each
        rank of the node carrying 1/G of it across nodes: a reduce-scatter over the node, an all-reduce
        of the slice over ``comm`` (cross-node), an all-gather over the node. The same bits on every rank."""
        G = self.size
        n = tensor.numel()
        padded = torch.zeros(-(-n // G) * G, dtype=tensor.dtype, device=tensor.device)  # (G ceil(n/G),)
        padded[:n].copy_(tensor)
        part = torch.empty(padded.numel() // G, dtype=tensor.dtype, device=tensor.device)
        self.intra.reduce_scatter(part, padded, tag)
        comm.all_reduce(part, tag)
        self.intra.all_gather(padded, part, tag)
        tensor.copy_(padded[:n])

    def broadcast(self, tensor: torch.Tensor, tag: str) -> None:
        """Local rank 0's ``tensor`` to the node."""
        self.intra.broadcast(tensor, 0, tag)

    def gather_params(self, flat_param: torch.Tensor, param_slice: torch.Tensor) -> None:
        """Dense step 3: every slice, updated by its rank, gathered in place into ``flat_param``."""
        self.intra.all_gather(flat_param, param_slice, "param_ag")

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Sparse step 3: (K,) new values of this slice's mask -> (G K,), every slice's, in slice order."""
        out = torch.empty(values.numel() * self.size, dtype=values.dtype, device=values.device)  # (G K,)
        self.intra.all_gather(out, values, "param_ag")
        return out

    def node_index(self, offsets, index, chunk_size, k_per_chunk, kernels) -> torch.Tensor:
        """The (G K,) int64 indices into the whole buffer of every slice's mask, from this slice's
        (K,) int16 ``offsets``: one all-gather of the encoded masks over the node (per refresh)."""
        encoded = kernels.encode_mask(offsets, chunk_size, k_per_chunk)  # (L,) uint8
        out = torch.empty(encoded.numel() * self.size, dtype=encoded.dtype, device=encoded.device)  # (G L,)
        self.intra.all_gather(out, encoded, "mask_ag")
        return offsets_to_index(kernels.decode_mask(out, chunk_size, k_per_chunk), chunk_size, k_per_chunk)

    def coefficient_layout(self, tiles: TileLayout):
        """basis "dct": the layout of this rank's slice of the coefficients, exchanged across nodes."""
        return tiles.node_slice(self.size)

    def accumulate_coefficients(self, tiles: TileLayout, grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor,
                                kernels, decay: float) -> None:
        """basis "dct": ``error`` ((numel/G,), this slice's error feedback) = decay * error + the node
        sum of this slice's coefficients of ``grad`` ((N_pad,), this rank's gradient): the whole
        gradient is transformed ((numel,) fp32, transient), then reduce-scattered over the node."""
        coef = torch.zeros(tiles.numel, dtype=error.dtype, device=error.device)  # (numel,) padding tiles 0
        to_coefficients(tiles, grad, coef, q, kernels)
        node_sum = torch.empty_like(error)  # (numel/G,)
        self.intra.reduce_scatter(node_sum, coef, "coef_rs")
        error.mul_(decay).add_(node_sum)

    def gather_coefficients(self, mean: torch.Tensor) -> torch.Tensor:
        """basis "dct": (numel/G,) this slice's mean coefficients -> (numel,) every slice's, the same
        bits on every rank of every node."""
        out = torch.empty(mean.numel() * self.size, dtype=mean.dtype, device=mean.device)  # (numel,)
        self.intra.all_gather(out, mean, "coef_ag")
        return out

    def gather_received(self, values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """basis "dct", mask "per_rank": what this rank received across nodes for its slice ((n,) fp32
        values, (n,) int16 in-tile offsets) -> every slice's, (G, n) each, over the node: O(M k) bytes
        instead of the (numel / G,) dense mean of :meth:`gather_coefficients`."""
        every = torch.empty(self.size * values.numel(), dtype=values.dtype, device=values.device)  # (G n,)
        self.intra.all_gather(every, values, "values_ag")
        every_offsets = all_gather_int16(self.intra, offsets, "offsets_ag")  # (G n,) int16
        return every.view(self.size, -1), every_offsets.view(self.size, -1)

    def dense_bytes(self, padded_numel: int, elem_bytes: int, dense_numel: int) -> int:
        """Intra-node bytes of a dense hierarchical step: reduce-scatter of (N_pad,), all-gather of
        the slice (N_pad / G,), all-reduce of the dense tensors (fp32)."""
        G = self.size
        return (collective_bytes("reduce_scatter", padded_numel * elem_bytes, G)
                + collective_bytes("all_gather", padded_numel // G * elem_bytes, G)
                + collective_bytes("all_reduce", dense_numel * 4, G))
